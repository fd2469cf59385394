"""Hypothesis strategies: random masked (B, T) batches of surprisals and losses."""
import torch
from hypothesis import strategies as st


@st.composite
def masked_batches(draw, max_b=5, max_t=9, allow_zero=True):
    "float64 (nll, base_nll, mask, rows) with ragged lengths >= 1; `rows` holds each row's supervised lengths."
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    lengths = [draw(st.integers(1, T)) for _ in range(B)]
    positive = st.floats(1e-3, 12.0, allow_nan=False, allow_infinity=False)
    value = st.one_of(st.just(0.0), positive) if allow_zero else positive
    base = [[draw(value) for _ in range(T)] for _ in range(B)]
    nll = [[draw(value) for _ in range(T)] for _ in range(B)]
    mask = torch.tensor([[1 if t < n else 0 for t in range(T)] for n in lengths])
    base_t = torch.tensor(base, dtype=torch.float64)
    nll_t = torch.tensor(nll, dtype=torch.float64)
    # padding may hold anything, including NaN: it must never be read
    pad = mask == 0
    base_t[pad], nll_t[pad] = float("nan"), float("nan")
    return nll_t, base_t, mask, lengths


gammas = st.floats(0.0, 6.0, allow_nan=False)
alphas = st.floats(0.0, 1.0, allow_nan=False)
