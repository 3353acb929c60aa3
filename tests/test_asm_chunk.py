"""The hand-written backwards of the chunked scan + read and of the slot-space linear attention
(:mod:`modeling.asm.asm_chunk`, the default CPU path of ``asa_attend`` and
``causal_linear_attention``) against the autograd-through-ops chunked forms and the float64
references: ``torch.autograd.gradcheck`` in float64 on small shapes, the references at realistic
shapes with left and right padding, and a hypothesis property over logit ranges, padding and
chunk sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from modeling.asm.asm_chunk import asa_attend_chunk, causal_linear_attention_chunk
from modeling.asm.asm_chunk_autograd import (
    asa_attend_chunk_autograd,
    causal_linear_attention_chunk_autograd,
)
from modeling.asm.asm_common import ScanState
from modeling.asm.asm_naive import asa_attend_naive, causal_linear_attention_naive
from modeling.asm.asm_ops import asa_attend, causal_linear_attention
from tests.test_properties_asm import (
    ISSUE_15,
    PROPERTY,
    TOL32,
    TOL64,
    assert_close,
    build,
    outputs_and_grads,
    scan_cases,
)


def graph_nodes(x: torch.Tensor) -> set[str]:
    """Names of the autograd nodes ``x`` depends on."""
    names, todo, seen = set(), [x.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(f for f, _ in node.next_functions)
    return names


def with_delta(fn):
    """``fn`` with a zero ``delta`` (unconnected) where it returns None (the gated gate), for
    ``outputs_and_grads``."""

    def wrapped(**kwargs):
        o, r, delta, *rest = fn(**kwargs)
        return o, r, torch.zeros_like(o) if delta is None else delta, *rest

    return wrapped


def padded_inputs(b: int, h: int, t: int, k: int, d: int, dtype: torch.dtype, seed: int = 0,
                  slope: float = 0.0) -> dict:
    """Scan inputs with row 0 left-padded by 5, the last row right-padded by 3 (``-inf``)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(t, dtype=torch.float64)[None, None, :, None]
    logits = 2.0 * torch.randn(b, h, t, k, generator=gen, dtype=torch.float64) + slope * pos
    logits[0, :, :5] = float("-inf")
    logits[-1, :, t - 3:] = float("-inf")
    return dict(
        logits=logits.to(dtype),
        v=torch.randn(b, h, t, d, generator=gen, dtype=torch.float64).to(dtype),
        q=(torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) / d ** 0.5).to(dtype),
        key_logits=torch.randn(b, h, t, k, generator=gen, dtype=torch.float64).to(dtype),
        gamma=torch.rand(h, generator=gen, dtype=torch.float64).to(dtype) * 3,
    )


@pytest.mark.parametrize("gate", [None, 0.7])
@pytest.mark.parametrize(("t", "chunk", "slope"), [(9, 4, 0.0), (8, 8, 1.5), (7, 3, -2.0)])
def test_gradcheck_scan_float64(t, chunk, slope, gate):
    """gradcheck of the scan + read (with a refinement between the scores and the read, and
    with the gated gate) with respect to logits, values, queries and key logits, including the
    final slot states ``num / den`` (``num`` and ``den`` alone are scaled by the detached
    running max); padded rows, several chunks, rising and falling logits."""
    inputs = padded_inputs(2, 2, t, 3, 2, torch.float64, seed=t, slope=slope)
    gamma = inputs.pop("gamma")
    w = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def fn(logits, v, q, key_logits):
        o, r, delta, final = asa_attend_chunk(
            logits, v, q, key_logits, gamma, 0.8, lambda x: torch.tanh(x @ w), chunk, None,
            gate)
        outs = (o, r, final.num / final.den.unsqueeze(-1))
        return outs + (delta,) if delta is not None else outs

    leaves = [x.clone().requires_grad_() for x in inputs.values()]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=True)


@pytest.mark.parametrize(("t", "chunk"), [(9, 4), (5, 2)])
def test_gradcheck_linear_attention_float64(t, chunk):
    """gradcheck of the chunked linear attention, outputs and final state, from a given
    initial state (its gradient included); one position's keys are zero (nothing written)."""
    gen = torch.Generator().manual_seed(t)
    q, k, v = (torch.rand(2, 2, t, 3, generator=gen, dtype=torch.float64) + 0.1
               for _ in range(3))
    k[0, :, 0] = 0.0
    s0 = torch.rand(2, 2, 3, 3, generator=gen, dtype=torch.float64)
    z0 = torch.rand(2, 2, 3, generator=gen, dtype=torch.float64)

    def fn(q, k, v, s0, z0):
        out, (s, z) = causal_linear_attention_chunk(q, k, v, chunk, (s0, z0))
        return out, s, z

    leaves = [x.requires_grad_() for x in (q, k, v, s0, z0)]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=True)


@pytest.mark.parametrize("chunk", [32, 64, 37])
@pytest.mark.parametrize("gated", [False, True])
def test_scan_matches_reference_at_realistic_shape(chunk, gated):
    """ASM-sized heads (K 16, d 64) over 100 positions with left and right padding, in
    float32: the outputs and every gradient equal the float64 reference and the
    autograd-through-ops chunk form (the tolerance of test_asm_kernels.py, atol relative to
    magnitudes above 1)."""
    inputs = padded_inputs(2, 2, 100, 16, 64, torch.float32, seed=chunk)
    kwargs = dict(gate=torch.tensor(0.3)) if gated else {}
    expected = outputs_and_grads(with_delta(asa_attend_naive), inputs, torch.float64, **kwargs)
    ops = outputs_and_grads(with_delta(asa_attend_chunk_autograd), inputs, torch.float32,
                            chunk_size=chunk, **kwargs)
    got = outputs_and_grads(with_delta(asa_attend_chunk), inputs, torch.float32,
                            chunk_size=chunk, **kwargs)
    for a, e, o in zip(got, expected, ops, strict=True):
        assert torch.isfinite(a).all()
        assert_close(a, e, TOL32)
        assert_close(a, o, TOL32)


def test_dispatcher_takes_the_hand_written_backward_on_cpu():
    """``asa_attend`` / ``causal_linear_attention`` on CPU tensors give the results of the
    chunk forms with hand-written backwards (their autograd nodes: ``_Read``, ``_Scores``,
    ``_ChunkLinearAttention``)."""
    inputs = padded_inputs(1, 2, 20, 4, 8, torch.float32)
    o = asa_attend(**{n: x.requires_grad_() for n, x in inputs.items()}, chunk_size=8)[0]
    assert "_ReadBackward" in graph_nodes(o)
    assert "_ScoresBackward" in graph_nodes(o)
    q = torch.rand(1, 2, 20, 4, requires_grad=True)
    out = causal_linear_attention(q, q, q, 8)[0]
    assert "_ChunkLinearAttentionBackward" in graph_nodes(out)


def test_partial_and_repeated_backward_passes():
    """The reads leave their logit and value gradients to the scores' backward: a pass that
    needs only the key logits' gradient (the scores' backward does not run) leaves nothing
    behind for the next, and two reads on one scan (the refinement's unfused ``delta``) and a
    retained graph run twice give the chunked form's gradients each time."""
    inputs = padded_inputs(2, 2, 40, 4, 8, torch.float64)
    w = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (asa_attend_chunk, asa_attend_chunk_autograd):
        leaves = {n: x.clone().requires_grad_() for n, x in inputs.items()}
        o, _, delta, _ = fn(**leaves, refine=lambda x: torch.tanh(x @ w), chunk_size=16)
        loss = (o * o).sum() + delta.sum()
        first = torch.autograd.grad(loss, leaves["key_logits"], retain_graph=True)
        grads.append([*first, *torch.autograd.grad(loss, list(leaves.values()),
                                                   retain_graph=True)])
        grads[-1] += torch.autograd.grad(loss, list(leaves.values()))
    for a, e in zip(*grads, strict=True):
        torch.testing.assert_close(a, e, **TOL64)


def test_steep_logits_fall_back_to_banded_reference():
    """A chunk whose running max rises by more than the band width (about 40 in float32) takes
    the banded autograd-through-ops path: the results equal it and the reference."""
    case = dict(ISSUE_15)
    inputs = build(case)
    expected = outputs_and_grads(asa_attend_naive, inputs, torch.float64)
    ops = outputs_and_grads(asa_attend_chunk_autograd, inputs, torch.float32, chunk_size=64)
    got = outputs_and_grads(asa_attend_chunk, inputs, torch.float32, chunk_size=64)
    for a, e, o in zip(got, expected, ops, strict=True):
        assert_close(a, e, TOL32)
        torch.testing.assert_close(a, o, rtol=0, atol=0)


def test_falling_logits_keep_one_band_per_chunk():
    """Logits falling by 30 per token from a slot's first write: the chunk's smallest logit is
    far below its reference but its running max is not, so the hand-written path is taken (no
    fallback) and equals the float64 reference."""
    inputs = padded_inputs(2, 2, 24, 3, 4, torch.float32, seed=5, slope=-30.0)
    leaves = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    assert "_ReadBackward" in graph_nodes(asa_attend_chunk(**leaves, chunk_size=8)[0])
    expected = outputs_and_grads(asa_attend_naive, inputs, torch.float64)
    got = outputs_and_grads(asa_attend_chunk, inputs, torch.float32, chunk_size=8)
    for a, e in zip(got, expected, strict=True):
        assert torch.isfinite(a).all()
        assert_close(a, e, TOL32)


@pytest.mark.parametrize("split", [1, 13, 32, 57])
def test_state_continuation_and_final_state_gradient(split):
    """Prefill in two parts (the second from the first's state) equals one pass, and the
    gradient through the final state ``(den, num)`` equals the chunked form's."""
    inputs = padded_inputs(2, 2, 70, 5, 6, torch.float32, seed=split)
    full = asa_attend_chunk(**inputs, chunk_size=16)
    part = {n: (x[:, :, :split] if x.dim() == 4 else x) for n, x in inputs.items()}
    rest = {n: (x[:, :, split:] if x.dim() == 4 else x) for n, x in inputs.items()}
    head = asa_attend_chunk(**part, chunk_size=16)
    tail = asa_attend_chunk(**rest, chunk_size=16, state=head[3])
    torch.testing.assert_close(torch.cat([head[0], tail[0]], dim=2), full[0], **TOL32)
    for a, e in zip((tail[3].m, tail[3].den, tail[3].num),
                    (full[3].m, full[3].den, full[3].num), strict=True):
        torch.testing.assert_close(a, e, **TOL32)
    grads = []
    for fn in (asa_attend_chunk, asa_attend_chunk_autograd):
        logits, v = (inputs[n].clone().requires_grad_() for n in ("logits", "v"))
        final = fn(logits, v, inputs["q"], inputs["key_logits"], inputs["gamma"],
                   chunk_size=16)[3]
        loss = (final.num * torch.linspace(-1, 1, final.num.numel()).view_as(final.num)).sum()
        grads.append(torch.autograd.grad(loss + final.den.sum(), (logits, v)))
    for a, e in zip(*grads, strict=True):
        assert_close(a, e, TOL32)


def test_initial_state_with_gradient_takes_the_reference_path():
    """An initial state that requires a gradient gets one, as from the chunked form."""
    inputs = padded_inputs(1, 2, 12, 3, 4, torch.float64)
    grads = []
    for fn in (asa_attend_chunk, asa_attend_chunk_autograd):
        num = torch.randn(1, 2, 3, 4, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(3)).requires_grad_()
        state = ScanState(m=torch.zeros(1, 2, 3, dtype=torch.float64),
                          den=torch.ones(1, 2, 3, dtype=torch.float64), num=num)
        o = fn(**inputs, chunk_size=5, state=state)[0]
        grads.append(torch.autograd.grad(o.sum(), num)[0])
    torch.testing.assert_close(grads[0], grads[1], **TOL64)


@pytest.mark.parametrize(("t", "chunk"), [(100, 32), (64, 64), (50, 7)])
def test_linear_attention_matches_reference(t, chunk):
    """Outputs, final state and the gradients of q, k, v equal the autograd-through-ops
    chunked form and (outputs) the float64 reference, in float32, with padded (zero-key)
    positions and rows whose normaliser stays 0 at the start."""
    gen = torch.Generator().manual_seed(t)
    q, k, v = (torch.rand(2, 3, t, 32, generator=gen) + 0.05 for _ in range(3))
    v = v - 0.5
    k[0, :, :7] = 0.0
    k[1, :, t - 4:] = 0.0
    results = []
    for fn in (causal_linear_attention_chunk, causal_linear_attention_chunk_autograd):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, (s, z) = fn(*leaves, chunk)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + s.sum() + z.sum()
        results.append((out, s, z, *torch.autograd.grad(loss, leaves)))
    for a, e in zip(*results, strict=True):
        assert torch.isfinite(a).all()
        assert_close(a.detach().double(), e.detach().double(), TOL32)
    assert_close(results[0][0].detach().double(), causal_linear_attention_naive(q, k, v), TOL32)


@PROPERTY
@given(case=scan_cases(), dtype=st.sampled_from([torch.float32, torch.float64]),
       gated=st.booleans())
@example(case=ISSUE_15, dtype=torch.float32, gated=False)
def test_fused_scan_matches_float64_reference(case, dtype, gated):
    """For any logit range (flat to +-30 per token per slot), offset, padding and chunk size,
    the hand-written backward's outputs and every input's gradient are finite and equal the
    float64 O(T^2) reference: rtol = atol = 1e-5 in float32, 1e-9 in float64 (atol relative
    to magnitudes above 1), with the refinement's read separate or gated with a gate."""
    inputs = build(case)
    kwargs = dict(gate=torch.tensor(0.6, dtype=dtype)) if gated else {}
    expected = outputs_and_grads(with_delta(asa_attend_naive), inputs, torch.float64, **kwargs)
    got = outputs_and_grads(with_delta(asa_attend_chunk), inputs, dtype,
                            chunk_size=case["chunk"], **kwargs)
    tol = TOL32 if dtype == torch.float32 else TOL64
    for a, e in zip(got, expected, strict=True):
        assert torch.isfinite(a).all()
        assert_close(a, e, tol)
