"""Plain-Python implementations written straight from the objective's definitions (lists, no tensors, no vectorisation).

They are deliberately naive: the tests compare the package's vectorised torch code against them.
"""
import math


def weights_loop(b, alpha, gamma):
    "u, w~, kappa, w, a for one example with surprisals `b` (all supervised)."
    T = len(b)
    u = [1.0 / T] * T
    bbar = sum(b) / T
    if bbar == 0:  # documented fallback: an all-zero row is uniform with kappa = 1
        return u, u[:], 1.0, u[:], u[:]
    powers = [x**gamma if x > 0 or gamma == 0 else 0.0 for x in b]
    w_tilde = [p / sum(powers) for p in powers]
    kappa = sum(w * x for w, x in zip(w_tilde, b)) / bbar
    w = [x / kappa for x in w_tilde]
    a = [alpha * ui + (1 - alpha) * wi for ui, wi in zip(u, w)]
    return u, w_tilde, kappa, w, a


def inverse_weights_loop(b, gamma, floor):
    "v~, kappa_inv, v of the inverse-surprisal ablation for one example."
    T = len(b)
    bbar = sum(b) / T
    if bbar == 0:
        return [1.0 / T] * T, 1.0, [1.0 / T] * T
    powers = [max(x, floor) ** (-gamma) for x in b]
    v_tilde = [p / sum(powers) for p in powers]
    kappa = sum(v * x for v, x in zip(v_tilde, b)) / bbar
    return v_tilde, kappa, [v / kappa for v in v_tilde]


def terms_loop(nll_rows, base_rows, c_ref, alpha, gamma, ex_floor=1e-6, inverse_floor=1e-3, topk_fraction=0.2, mean_one_lambda=0.5):
    "Every reconstruction term, batch mean over examples; rows are lists of supervised values only."
    acc = {k: 0.0 for k in ("std", "dist", "ex", "tok", "tok_cc", "inv_tok", "theta", "topk", "mean1")}
    for l, b in zip(nll_rows, base_rows):
        T = len(l)
        lbar, bbar = sum(l) / T, sum(b) / T
        u, w_tilde, kappa, w, a = weights_loop(b, alpha, gamma)
        v_tilde, kappa_inv, v = inverse_weights_loop(b, gamma, inverse_floor)
        acc["std"] += lbar
        acc["dist"] += lbar / c_ref
        acc["ex"] += lbar / max(bbar, ex_floor)
        acc["tok"] += sum(x * y for x, y in zip(w_tilde, l))
        acc["tok_cc"] += sum(x * y for x, y in zip(w_tilde, l)) / kappa / c_ref
        acc["inv_tok"] += sum(x * y for x, y in zip(v, l)) / c_ref
        acc["theta"] += sum(x * y for x, y in zip(a, l)) / c_ref
        k = max(1, math.ceil(topk_fraction * T))
        order = sorted(range(T), key=lambda t: (-b[t], t))[:k]  # highest surprisal first, earlier position on ties
        acc["topk"] += sum(l[t] for t in order) / k
        ratio = [x / bbar if bbar > 0 else 1.0 for x in b]
        acc["mean1"] += sum((mean_one_lambda * r + 1 - mean_one_lambda) / T * y for r, y in zip(ratio, l))
    return {k: v / len(nll_rows) for k, v in acc.items()}


def categorical_kl_loop(q_logits, r_logits):
    "KL(q || r) for one pair of logit lists."
    def softmax(z):
        m = max(z)
        e = [math.exp(x - m) for x in z]
        return [x / sum(e) for x in e]
    q, r = softmax(q_logits), softmax(r_logits)
    return sum(qi * (math.log(qi) - math.log(ri)) for qi, ri in zip(q, r) if qi > 0)
