"""The fused slot-addressing kernel (issue 81) against its float64 reference and the model's own
unfused computation (TRITON_INTERPRET=1 on CPU: tests/conftest.py sets it, before any kernel
module is imported, when no GPU is visible; its autouse fixture restores the environment after
every test)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

pytest.importorskip("triton")

from modeling.asm import asm_ops  # noqa: E402
from modeling.asm import asm_triton_addressing as addressing  # noqa: E402
from modeling.asm.asm_naive import slot_addressing_naive  # noqa: E402
from modeling.asm.asm_triton_addressing import slot_addressing_triton  # noqa: E402
from tests.test_asm_addressing import (  # noqa: E402
    DEVICE,
    SHAPES,
    assert_close,
    assert_matches_reference,
    captured_logits,
    make_inputs,
    model_case,
    run,
    shape_id,
    small_cases,
    to_device,
)


@pytest.mark.parametrize("recency", [False, True], ids=["no-recency", "recency"])
@pytest.mark.parametrize("rotary", [False, True], ids=["no-rotary", "rotary"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_outputs_and_every_gradient_match_float64_reference(shape, rotary, recency):
    b, t, h, k, d, steep = shape
    assert_matches_reference(make_inputs(b, t, h, k, d, steep, rotary, recency),
                             slot_addressing_triton)


def test_masked_positions_get_no_key_gradient():
    """Padding on either side: no gradient reaches the keys there (the queries' key logits are
    not masked, so their gradient does)."""
    x = make_inputs(2, 12, 2, 5, 4, left=3, right=4)
    dkey, dq = run(slot_addressing_triton, x, torch.float32)[2:4]
    pad = ~x["valid"][:, None, :, None].expand_as(dkey)
    assert (dkey[pad] == 0).all() and (dkey[~pad] != 0).all()
    assert (dq[pad] != 0).all()


def test_bfloat16_inputs_give_float32_outputs():
    """bf16 key, q, slot_keys: float32 outputs equal to the float64 reference on the same
    (bf16-valued) inputs; gradients in bf16."""
    x = make_inputs(2, 20, 2, 5, 8)
    for n in ("key", "q", "slot_keys"):
        x[n] = x[n].to(torch.bfloat16)
    got = run(slot_addressing_triton, x, torch.bfloat16)
    expected = run(slot_addressing_naive, x, torch.float64)
    for a, e in zip(got[:2], expected[:2], strict=True):
        assert_close(a, e)
    for a, e in zip(got[2:], expected[2:], strict=True):
        assert_close(a, e, dict(rtol=1.6e-2, atol=1e-2))
    leaves = [x[n].to(DEVICE).requires_grad_() for n in ("key", "q", "slot_keys")]
    out = slot_addressing_triton(*leaves, None, x["positions"].to(DEVICE), x["valid"].to(DEVICE),
                                 None, 1.0, 1.0)
    assert [o.dtype for o in out] == [torch.float32, torch.float32]
    out[1].sum().backward()
    assert [y.grad.dtype for y in leaves] == [torch.bfloat16] * 3


@settings(max_examples=10, deadline=None, print_blob=True)
@given(x=small_cases())
def test_kernel_matches_float64_reference_property(x):
    """Any small shape (odd K and d, T from 1), padding, steepness, rotary and recency."""
    assert_matches_reference(x, slot_addressing_triton)


@pytest.mark.parametrize("rotary", [False, True], ids=["no-rotary", "rotary"])
def test_the_model_on_triton_takes_the_kernel_and_equals_its_pytorch_form(monkeypatch, rotary):
    """ASAAttention.forward on a Triton backend addresses its slots through the kernel (the
    dispatcher's choice), and its logits equal the PyTorch backend's to the float32
    tolerance, on the head's transposed views of the fused q/k/v product."""
    attn, hidden, positions, valid, args = model_case(rotary)
    attn.to(DEVICE)
    calls = []
    real = asm_ops.slot_addressing_triton

    def counted(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(asm_ops, "slot_addressing_triton", counted)
    on_triton = captured_logits(monkeypatch, attn, *to_device((hidden, positions, valid)),
                                "triton_chunk")
    assert calls == [1]
    attn.cpu()
    on_torch = captured_logits(monkeypatch, attn, hidden, positions, valid, "torch")
    for a, e in zip(on_triton, on_torch, strict=True):
        assert_close(a.cpu().double(), e.double())
    expected = slot_addressing_naive(*[a.double() if torch.is_tensor(a) and a.is_floating_point()
                                       else a for a in args[:3]], *args[3:])
    for a, e in zip(slot_addressing_triton(*to_device(args)), expected, strict=True):
        assert_close(a.cpu().double(), e)


def test_clear_errors(monkeypatch):
    x = make_inputs(1, 4, 2, 3, 4)
    cpu = (x["key"], x["q"], x["slot_keys"], None, x["positions"], x["valid"], None, 1.0, 1.0)
    args = to_device(cpu)
    with pytest.raises(ValueError, match="slot_keys"):
        slot_addressing_triton(args[0], args[1], args[2][:1], *args[3:])
    with pytest.raises(ValueError, match="recency"):
        slot_addressing_triton(*args[:6], torch.ones(3, device=DEVICE), 1.0, 1.0)
    monkeypatch.setattr(addressing, "triton", None)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        slot_addressing_triton(*args)
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    with pytest.raises(RuntimeError, match="CUDA"):
        slot_addressing_triton(*cpu)
