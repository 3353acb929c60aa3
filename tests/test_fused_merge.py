"""The fused Triton merge of the banks into the history's output
(``hf_memory.steering.fused_merge``), interpreted on the CPU (``TRITON_INTERPRET=1``,
tests/conftest.py; compiled for real in tests/test_gpu.py): against the float64 bank-level
mixture on the property cases of ``bank_mixture_by_lse`` and against that PyTorch path itself
on the layouts a steered layer hands it (strided history and queries, counts per row or one
constant, several row blocks, unaligned slot counts, half-precision output), and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

pytest.importorskip("triton")

from hf_memory.steering.fused_merge import (  # noqa: E402
    fused_bank_mixture_by_lse,
    fused_merge_applies,
)
from hf_memory.steering.mixture import (  # noqa: E402
    BankStack,
    HeadSlots,
    PreparedBank,
    bank_mixture_by_lse,
    toward,
)
from tests.test_properties_cores import (  # noqa: E402
    EXTREME,
    PROPERTY,
    build_mixture,
    compute_tolerance,
    lse_operands,
    mixture_cases,
    reference_mixture,
    rounded,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (else interpreted)


def on_device(slots: HeadSlots) -> HeadSlots:
    return HeadSlots(**{name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                        for name, value in vars(slots).items()})


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # σ(−1e3) = 0
@PROPERTY
@given(case=mixture_cases(masked_rows=True), strength=st.sampled_from([1.0, 0.35]))
@example(case=EXTREME, strength=1.0)
@example(case=EXTREME, strength=0.35)
def test_fused_merge_equals_the_bank_level_mixture(case, strength):
    """On every case of the PyTorch path's property test (grouped-query heads, one and several
    banks, pre/post-RoPE and mixed slot columns, the contrastive gate, five masks, scores up to
    1e3, rows that see no key): the float64 bank-level mixture within the float32 tolerance
    that path is held to, and that path itself within float32 rounding."""
    inputs = build_mixture(case)
    compute = torch.float32
    expected, _, peak = reference_mixture(rounded(inputs, compute), case)
    (history, *tensors, slots), log_count = lse_operands(inputs, case, compute)
    args = (*(x.to(DEVICE) for x in (history, *tensors)), on_device(slots))
    log_count = log_count.to(DEVICE)
    kwargs = dict(scaling=inputs["scaling"], log_count=log_count, gamma=case["gamma"],
                  size_normalize=case["size_normalize"], strength=strength)
    fused = fused_bank_mixture_by_lse(*args, **kwargs)
    assert fused.dtype == compute and torch.isfinite(fused).all()
    tol = compute_tolerance(compute, peak)
    want = toward(history.double(), expected, strength)
    torch.testing.assert_close(fused.transpose(1, 2).cpu().double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(fused, bank_mixture_by_lse(*args, **kwargs), rtol=1e-5,
                               atol=1e-5 * max(1.0, peak or 1.0))


def layer_slots(kv_heads: int, heads: int, d: int, sizes: tuple[int, ...], *, post: bool,
                seed: int) -> HeadSlots:
    gen = torch.Generator().manual_seed(seed)
    roles = ("target", "reference", "auxiliary")[:len(sizes)]
    banks = [PreparedBank(role, torch.randn(kv_heads, m, d, generator=gen),
                          torch.randn(kv_heads, m, d, generator=gen), 0.7 + 0.3 * i,
                          post and role == "reference")
             for i, (role, m) in enumerate(zip(roles, sizes, strict=True))]
    stack = BankStack.of(banks, rho=1.3, size_normalize=True)
    return HeadSlots.of(stack, torch.arange(heads) // (heads // kv_heads))


LAYOUTS = {  # name -> batch, KV heads, group, tokens, head width, bank sizes, post-RoPE bank
    "decode": (3, 2, 3, 1, 64, (24, 24), False),
    "decode-one-bank": (1, 8, 4, 1, 64, (24,), False),
    "prefill-rows": (2, 2, 2, 21, 64, (11, 13, 5), True),
    "wide-head": (2, 1, 2, 3, 256, (30, 34), False),  # Gemma's heads: the largest tile
}


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("counts", ["per-row", "constant", "none"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_merge_equals_the_torch_merge_on_a_layers_layouts(layout, counts, out_dtype):
    """The operands as a steered layer has them: the history and the queries as strided views
    of ``[B, T, H, D]`` buffers (what SDPA returns and the projections make), the log-sum-exp
    ``[B, Hs, T]`` with some rows blind (−inf), log T_t per row, one constant or off; more rows
    than one program's 16; slot counts that are no power of two; a bf16 output."""
    batch, kv_heads, group, t, d, sizes, post = LAYOUTS[layout]
    heads = kv_heads * group
    gen = torch.Generator().manual_seed(len(layout) + len(counts))
    history, q_pre, q_post = (torch.randn(batch, t, heads, d, generator=gen).transpose(1, 2)
                              for _ in range(3))
    history = history.bfloat16()  # the model's dtype
    lse = torch.randn(batch, heads, t, generator=gen) * 4
    lse[0, 0, 0] = float("-inf")
    slots = layer_slots(kv_heads, heads, d, sizes, post=post, seed=t)
    log_count = {"per-row": torch.rand(1, 1, t, generator=gen) * 5,
                 "constant": math.log(37.0), "none": 0.0}[counts]
    args = [x.to(DEVICE) for x in (history, lse, q_pre, q_post)]
    kwargs = dict(scaling=d ** -0.5, gamma=1.7, strength=0.6 if counts == "constant" else 1.0,
                  size_normalize=counts != "none", out_dtype=out_dtype,
                  log_count=log_count.to(DEVICE) if counts == "per-row" else log_count)
    fused = fused_bank_mixture_by_lse(*args, on_device(slots), **kwargs)
    want = bank_mixture_by_lse(*args, on_device(slots), **kwargs)
    assert fused.shape == (batch, t, heads, d) and fused.dtype == want.dtype
    # bf16: the two float32 results (within 1e-5) may round to neighbouring bf16 values, one
    # ulp apart (at most 2^-7 relative)
    tol = dict(rtol=1e-5, atol=1e-5) if out_dtype is None else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(fused.float(), want.float(), **tol)


def test_fused_merge_refuses_what_it_cannot_compute():
    slots = layer_slots(1, 2, 8, (4, 4), post=False, seed=0)
    x = torch.randn(1, 2, 1, 8)
    lse = torch.zeros(1, 2, 1)
    wide = HeadSlots(**{**vars(slots), "keys_t": slots.keys_t.double(),
                        "values": slots.values.double()})
    with pytest.raises(ValueError, match="computes in float32"):
        fused_bank_mixture_by_lse(x, lse, x, x, wide, scaling=1.0)
    many = layer_slots(1, 2, 8, (1100,), post=False, seed=0)
    with pytest.raises(ValueError, match="up to 16384"):
        fused_bank_mixture_by_lse(x, lse, x, x, many, scaling=1.0)
    assert not fused_merge_applies(x, slots)  # a CPU tensor: the PyTorch path
