"""Shared-prefix enumeration of the K codes: the packed sequence gives the unshared per-code losses and router logits."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from basedirected.cvae import CVAEConfig, DiscreteCVAE
from basedirected.model import EncodedExamples, ModelConfig, TinyCausalLM, as_rows
from basedirected.tasks import Vocab
import basedirected.train  # noqa: F401  (registers the package's tasks)
from basedirected.tasks import Task


def _model(task, K, seed):
    vocab = Vocab.for_task(task, n_latent=8)
    torch.manual_seed(seed)
    base = TinyCausalLM(len(vocab), ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=96))
    model = DiscreteCVAE(base, vocab, CVAEConfig(K=K), seed=seed)
    with torch.no_grad():
        for p in model.generator.parameters(): p.add_(0.1 * torch.randn_like(p))  # codes that change the losses
    return model.eval(), vocab


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(n for n, c in Task.registry.items() if c.__module__.startswith("basedirected."))), K=st.integers(1, 6), n=st.integers(1, 9), seed=st.integers(0, 1000))
def test_packed_codes_equal_unshared_rows(name, K, n, seed):
    task = Task.registry[name].early() if name == "visiting_order" else Task.registry[name]()
    model, vocab = _model(task, K, seed)
    exs = task.generate(n, seed)
    for rows in (EncodedExamples(vocab, exs).select(list(range(n))[::-1]), as_rows(vocab, exs, "cpu")):
        with torch.no_grad():
            model.shared_prefix = False; ref = model(rows)
            model.shared_prefix = True; got = model(rows)
        torch.testing.assert_close(got.nll_per_code, ref.nll_per_code, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.r_logits, ref.r_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.q_logits, ref.q_logits)
        assert torch.equal(got.mask, ref.mask)


def test_packed_codes_carry_the_gradient_of_the_unshared_rows():
    task = Task.registry["sorting"]()
    model, vocab = _model(task, 4, 0)
    rows = as_rows(vocab, task.generate(5, 1), "cpu")
    grads = []
    for shared in (False, True):
        model.shared_prefix = shared; model.zero_grad()
        model(rows).nll.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.generator.parameters() if p.grad is not None]))
    # float32 sums in another order: an element near zero that cancels large terms is off by round-off of the largest (|g| up to ~60)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6 * grads[0].abs().max().item())
