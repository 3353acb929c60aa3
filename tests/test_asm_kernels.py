"""ASA kernels: the chunk-parallel PyTorch forms against the O(T^2) float64 references."""

from __future__ import annotations

import pytest
import torch

from modeling.asm import (
    ScanState,
    asa_attend_chunk_autograd,
    asa_attend_naive,
    causal_linear_attention_chunk_autograd,
    causal_linear_attention_naive,
    slot_states_naive,
)
from modeling.asm.asm_common import band_width, scan_bands
from modeling.asm.modeling_asm import alibi_slopes

TOL = dict(rtol=1e-5, atol=1e-5)
SHAPES = [(1, 1, 1, 1, 1), (2, 63, 4, 16, 8), (1, 17, 3, 7, 5), (2, 40, 2, 4, 6), (3, 9, 1, 2, 3)]


def shape_id(shape: tuple[int, ...]) -> str:
    b, t, h, k, d = shape
    return f"B{b}-T{t}-H{h}-K{k}-d{d}"


def make_inputs(b: int, t: int, h: int, k: int, d: int, pad: bool = True, logit_scale: float = 2.0):
    """Random scan inputs; row 0 left-padded, row 1 right-padded (when present)."""
    logits = torch.randn(b, h, t, k) * logit_scale
    if pad and t > 2:
        logits[0, :, : t // 3] = float("-inf")
        if b > 1:
            logits[1, :, t - t // 4:] = float("-inf")
    return dict(
        logits=logits,
        v=torch.randn(b, h, t, d),
        q=torch.randn(b, h, t, d) / d ** 0.5,
        key_logits=torch.randn(b, h, t, k),
        gamma=torch.rand(h) * 3,
    )


def run(fn, inputs: dict, weight: torch.Tensor, dtype: torch.dtype, gated: bool, **kwargs):
    """Run ``fn`` on leaf copies of ``inputs``; return outputs and the gradients of a fixed
    random projection of every output with respect to every input."""
    leaves = {name: x.detach().to(dtype).requires_grad_() for name, x in inputs.items()}
    w = weight.detach().to(dtype).requires_grad_()
    gate = torch.tensor(0.7, dtype=dtype, requires_grad=True)
    refine = lambda r: torch.tanh(r.to(dtype) @ w)  # noqa: E731
    result = fn(**leaves, read_temperature=0.8, refine=refine, gate=gate if gated else None,
                **kwargs)
    o, r, delta = result[:3]
    outs = [o, r] + ([] if gated else [delta])
    gen = torch.Generator().manual_seed(1)
    loss = sum((x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64)).sum()
               for x in outs)
    params = list(leaves.values()) + [w] + ([gate] if gated else [])
    grads = torch.autograd.grad(loss, params)
    return [x.detach().double() for x in outs], [g.double() for g in grads]


@pytest.mark.parametrize("gated", [False, True], ids=["split", "gated"])
@pytest.mark.parametrize("chunk", [1, 8, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_chunked_matches_reference_outputs_and_every_gradient(shape, chunk, gated):
    b, t, h, k, d = shape
    inputs = make_inputs(*shape)
    weight = torch.randn(k, k)
    ref_out, ref_grad = run(asa_attend_naive, inputs, weight, torch.float64, gated)
    out, grad = run(asa_attend_chunk_autograd, inputs, weight, torch.float32, gated,
                    chunk_size=chunk)
    for a, e in zip(out, ref_out, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, **TOL)
    for a, e in zip(grad, ref_grad, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, **TOL)


@pytest.mark.parametrize("shape", [(2, 29, 2, 5, 4), (1, 50, 3, 16, 8)], ids=shape_id)
def test_chunk_size_invariance(shape):
    inputs = make_inputs(*shape)
    weight = torch.randn(shape[3], shape[3])
    results = [run(asa_attend_chunk_autograd, inputs, weight, torch.float32, False, chunk_size=c)
               for c in (1, 3, 8, 16, shape[1])]
    first_out, first_grad = results[0]
    for out, grad in results[1:]:
        for a, e in zip(out + grad, first_out + first_grad, strict=True):
            torch.testing.assert_close(a, e, **TOL)


def test_long_range_of_logits_across_chunks_stays_exact():
    """Logits rising by 0.5 per position span 100 over T = 200 (beyond float32's exp range);
    the per-chunk reference max keeps every chunk in range."""
    b, t, h, k, d = 1, 200, 2, 4, 4
    inputs = make_inputs(b, t, h, k, d, pad=False, logit_scale=1.0)
    inputs["logits"] = inputs["logits"] + 0.5 * torch.arange(t, dtype=torch.float32)[:, None]
    weight = torch.randn(k, k)
    ref_out, _ = run(asa_attend_naive, inputs, weight, torch.float64, False)
    out, _ = run(asa_attend_chunk_autograd, inputs, weight, torch.float32, False, chunk_size=16)
    for a, e in zip(out, ref_out, strict=True):
        torch.testing.assert_close(a, e, **TOL)


def test_gradcheck_reference_float64():
    gen = torch.Generator().manual_seed(3)
    b, t, h, k, d = 1, 5, 2, 3, 2
    logits = torch.randn(b, h, t, k, generator=gen, dtype=torch.float64)
    logits[:, :, 0] = float("-inf")
    args = [logits, torch.randn(b, h, t, d, generator=gen, dtype=torch.float64),
            torch.randn(b, h, t, d, generator=gen, dtype=torch.float64),
            torch.randn(b, h, t, k, generator=gen, dtype=torch.float64),
            torch.rand(h, generator=gen, dtype=torch.float64) + 0.5,
            torch.randn(k, k, generator=gen, dtype=torch.float64)]
    args = [a.requires_grad_() for a in args]

    def fn(lg, v, q, kl, gamma, w):
        o, r, delta = asa_attend_naive(lg, v, q, kl, gamma, 0.9, lambda x: torch.tanh(x @ w))
        return o, r, delta

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)
    lin = [torch.rand(1, 2, 6, 3, generator=gen, dtype=torch.float64).requires_grad_()
           for _ in range(3)]
    assert torch.autograd.gradcheck(causal_linear_attention_naive, lin, eps=1e-6, atol=1e-6)


def test_reference_slot_states_are_the_papers_formula():
    """``slot_s(t) = sum_{tau<=t} exp(l) v / sum_{tau<=t} exp(l)`` written out as a loop."""
    logits, v = torch.randn(1, 1, 6, 2, dtype=torch.float64), torch.randn(1, 1, 6, 3,
                                                                          dtype=torch.float64)
    slots = slot_states_naive(logits, v)
    for t in range(6):
        for s in range(2):
            e = logits[0, 0, : t + 1, s].exp()
            expected = (e[:, None] * v[0, 0, : t + 1]).sum(0) / e.sum()
            torch.testing.assert_close(slots[0, 0, t, s], expected)


@pytest.mark.parametrize("chunk", [4, 64], ids=lambda c: f"C{c}")
def test_causality(chunk):
    """Changing positions >= 13 leaves earlier outputs unchanged: bit-exact in earlier chunks,
    up to rounding inside the chunk holding position 13 (its reference max may move)."""
    b, t, h, k, d = 2, 21, 2, 5, 4
    inputs = make_inputs(b, t, h, k, d, pad=False)
    weight = torch.randn(k, k)
    out, _ = run(asa_attend_chunk_autograd, inputs, weight, torch.float32, False, chunk_size=chunk)
    changed = {name: x.clone() for name, x in inputs.items()}
    for name in ("logits", "v", "q", "key_logits"):
        changed[name][:, :, 13:] = torch.randn_like(changed[name][:, :, 13:])
    out2, _ = run(asa_attend_chunk_autograd, changed, weight, torch.float32, False,
                  chunk_size=chunk)
    first = 13 // chunk * chunk
    for a, e in zip(out2, out, strict=True):
        assert torch.equal(a[:, :, :first], e[:, :, :first])
        torch.testing.assert_close(a[:, :, first:13], e[:, :, first:13], **TOL)
        assert not torch.allclose(a[:, :, 13:], e[:, :, 13:])


@pytest.mark.parametrize("split", [1, 7, 20], ids=lambda s: f"split{s}")
def test_state_continuation_equals_one_pass(split):
    """Prefill ``[0, split)`` then continue from the returned state (decoding is the same code)."""
    b, t, h, k, d = 2, 21, 2, 5, 4
    x = make_inputs(b, t, h, k, d)
    full = asa_attend_chunk_autograd(**x, chunk_size=8)
    head = asa_attend_chunk_autograd(**{n: (v[:, :, :split] if v.dim() == 4 else v)
                                 for n, v in x.items()}, chunk_size=8)
    state = head[3]
    pieces = [head[0]]
    for i in range(split, t):
        step = asa_attend_chunk_autograd(**{n: (v[:, :, i:i + 1] if v.dim() == 4 else v)
                                     for n, v in x.items()}, chunk_size=8, state=state)
        pieces.append(step[0])
        state = step[3]
    torch.testing.assert_close(torch.cat(pieces, dim=2), full[0], **TOL)
    for a, e in zip((state.m, state.den, state.num), (full[3].m, full[3].den, full[3].num),
                    strict=True):
        torch.testing.assert_close(a, e, **TOL)


def test_fully_padded_rows_are_finite_with_finite_gradients():
    inputs = make_inputs(2, 12, 2, 3, 4, pad=False)
    inputs["logits"][0] = float("-inf")
    weight = torch.randn(3, 3)
    out, grad = run(asa_attend_chunk_autograd, inputs, weight, torch.float32, True, chunk_size=5)
    assert all(torch.isfinite(x).all() for x in out + grad)
    assert torch.equal(out[0][0], torch.zeros_like(out[0][0]))
    ref_out, ref_grad = run(asa_attend_naive, inputs, weight, torch.float64, True)
    for a, e in zip(out + grad, ref_out + ref_grad, strict=True):
        torch.testing.assert_close(a, e, **TOL)


def test_empty_state_matches_no_state():
    x = make_inputs(1, 5, 1, 2, 3)
    empty = ScanState.empty(1, 1, 2, 3, torch.device("cpu"), torch.float32)
    assert torch.equal(asa_attend_chunk_autograd(**x, state=empty)[0],
                       asa_attend_chunk_autograd(**x)[0])


@pytest.mark.parametrize("chunk", [1, 4, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("b, t, h, m", [(1, 1, 1, 2), (2, 33, 3, 6), (1, 20, 2, 32)],
                         ids=lambda x: str(x))
def test_causal_linear_attention_chunked_matches_reference(b, t, h, m, chunk):
    phi_q = torch.rand(b, h, t, m) + 0.1
    phi_k = torch.rand(b, h, t, m) + 0.1
    if t > 2:
        phi_k[0, :, : t // 3] = 0.0  # left padding writes nothing
    v = torch.randn(b, h, t, m)
    leaves64 = [x.double().requires_grad_() for x in (phi_q, phi_k, v)]
    leaves32 = [x.clone().requires_grad_() for x in (phi_q, phi_k, v)]
    ref = causal_linear_attention_naive(*leaves64)
    out, (s, z) = causal_linear_attention_chunk_autograd(*leaves32, chunk_size=chunk)
    torch.testing.assert_close(out.double(), ref, **TOL)
    torch.testing.assert_close(s.double(), (phi_k.double().transpose(-1, -2) @ v.double()),
                               **TOL)
    torch.testing.assert_close(z.double(), phi_k.double().sum(2), **TOL)
    proj = torch.randn(out.shape, dtype=torch.float64)
    g_ref = torch.autograd.grad((ref * proj).sum(), leaves64)
    g = torch.autograd.grad((out.double() * proj).sum(), leaves32)
    for a, e in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a.double(), e, **TOL)


def steep_inputs(case: str, b: int = 2, t: int = 130, h: int = 2, k: int = 3, d: int = 4,
                 dtype: torch.dtype = torch.float32, left: int | None = None) -> dict:
    """Scan inputs whose write logits rise steeply over the real tokens (positions counted from
    0 in each row; row 0 left-padded by ``t // 3`` or ``left`` positions, row 1 right-padded):
    ``rise2`` adds 2 per token to every slot; ``recency4`` is the model's recency bias at
    strength 4, ``4 a_h p`` with the ALiBi slopes of an 8-head layer (2 and 1 per token for the
    first two heads); ``rise50`` adds 50 per token (more bands than any chunk has positions
    would need without their cap)."""
    x = make_inputs(b, t, h, k, d)
    if left is not None:
        x["logits"][0] = torch.randn(h, t, k) * 2.0
        x["logits"][0, :, :left] = float("-inf")
    valid = torch.isfinite(x["logits"][:, 0, :, 0])  # [B, T]
    pos = (valid.cumsum(1) - 1).clamp_min(0).to(torch.float32)[:, None, :, None]
    if case == "recency4":
        slopes = torch.tensor(alibi_slopes(8)[:h])[None, :, None, None]
        ramp = 4.0 * slopes * pos
    else:
        ramp = {"rise2": 2.0, "rise50": 50.0}[case] * pos
    x["logits"] = x["logits"] + ramp
    return {name: v.to(dtype) for name, v in x.items()}


@pytest.mark.parametrize("gated", [False, True], ids=["split", "gated"])
@pytest.mark.parametrize("case", ["rise2", "recency4", "rise50"])
def test_steep_logits_chunk_64_match_chunk_1_and_reference(case, gated):
    """Issue 15: write logits rising by more than ~88 inside one chunk underflowed the early
    positions' denominators (zeros, then NaN). At chunk 64 in float32 the outputs and every input
    gradient are finite and equal chunk 1 and the float64 O(T^2) reference (rtol = atol = 1e-5)."""
    inputs = steep_inputs(case)
    weight = torch.randn(3, 3)
    ref_out, ref_grad = run(asa_attend_naive, inputs, weight, torch.float64, gated)
    one_out, one_grad = run(asa_attend_chunk_autograd, inputs, weight, torch.float32, gated,
                            chunk_size=1)
    out, grad = run(asa_attend_chunk_autograd, inputs, weight, torch.float32, gated, chunk_size=64)
    for a, one, e in zip(out + grad, one_out + one_grad, ref_out + ref_grad, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, **TOL)
        torch.testing.assert_close(a, one, **TOL)


def test_steep_logits_need_bands_but_at_most_one_per_position():
    """The banded references: a chunk whose running max rises by less than ~40 (float32) needs
    one reference; logits rising by 2 per token need ceil(126 / 40) = 4 in a chunk of 64; however
    steep, never more bands than the chunk has positions."""
    flat = make_inputs(2, 130, 2, 3, 4)["logits"]
    m = torch.full((2, 2, 3), float("-inf"))
    width = band_width(torch.float32)
    assert 39 < width < 40
    assert scan_bands(flat, m, 64, width).count == [1, 1, 1]
    assert scan_bands(steep_inputs("rise2")["logits"], m, 64, width).count[0] == 4
    counts = scan_bands(steep_inputs("rise50")["logits"], m, 64, width).count
    assert counts[0] == 64 and counts[2] == 2
    assert scan_bands(steep_inputs("rise50")["logits"], m, 1, width).count == [1] * 130


@pytest.mark.parametrize("case", ["rise2", "recency4"])
def test_steep_logits_prefill_equals_token_by_token_decode(case):
    """Prefill of 70 steep positions at chunk 64, then one-token steps from the returned state
    (the decode path), equal one pass and the float64 reference; so does the final state."""
    x = steep_inputs(case, t=90)
    ref = asa_attend_naive(**x)[0]
    full = asa_attend_chunk_autograd(**x, chunk_size=64)
    head = asa_attend_chunk_autograd(**{n: (v[:, :, :70] if v.dim() == 4 else v) for n,
                                        v in x.items()},
                              chunk_size=64)
    state, pieces = head[3], [head[0]]
    for i in range(70, 90):
        step = asa_attend_chunk_autograd(**{n: (v[:, :, i:i + 1] if v.dim() == 4 else v)
                                     for n, v in x.items()}, chunk_size=64, state=state)
        pieces.append(step[0])
        state = step[3]
    decoded = torch.cat(pieces, dim=2)
    assert torch.isfinite(decoded).all()
    torch.testing.assert_close(decoded.double(), ref, **TOL)
    torch.testing.assert_close(decoded, full[0], **TOL)
    for a, e in zip((state.m, state.den, state.num), (full[3].m, full[3].den, full[3].num),
                    strict=True):
        torch.testing.assert_close(a, e, **TOL)


def test_steep_logits_float64_chunked_matches_reference():
    """The chunked form in float64 (bands of ~319) on logits rising by 50 per token."""
    inputs = steep_inputs("rise50", t=70, dtype=torch.float64)
    weight = torch.randn(3, 3)
    ref_out, ref_grad = run(asa_attend_naive, inputs, weight, torch.float64, False)
    out, grad = run(asa_attend_chunk_autograd, inputs, weight, torch.float64, False, chunk_size=64)
    for a, e in zip(out + grad, ref_out + ref_grad, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)
