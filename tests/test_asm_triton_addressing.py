"""The fused slot-addressing kernel (issue 81) against its float64 reference and the model's own
unfused computation (TRITON_INTERPRET=1 on CPU: tests/conftest.py sets it, before any kernel
module is imported, when no GPU is visible; its autouse fixture restores the environment after
every test)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from modeling.asm import ASAAttention, ASMConfig, modeling_asm  # noqa: E402
from modeling.asm import asm_triton_addressing as addressing  # noqa: E402
from modeling.asm.asm_triton_addressing import (  # noqa: E402
    slot_addressing_naive,
    slot_addressing_triton,
)
from tests.test_properties_asm import TOL32  # noqa: E402
from tests.test_properties_asm import assert_close as assert_close_scaled  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (B, T, H, K, d, steepness): tiny odd shapes, the ASM-57M head, steep keys (key * 30)
SHAPES = [(1, 1, 2, 5, 3, 1.0), (2, 37, 2, 5, 3, 1.0), (2, 37, 2, 5, 4, 30.0),
          (2, 64, 8, 16, 48, 1.0), (2, 64, 8, 16, 48, 30.0)]


def shape_id(shape) -> str:
    b, t, h, k, d, steep = shape
    return f"B{b}-T{t}-H{h}-K{k}-d{d}" + ("-steep" if steep != 1.0 else "")


def tables(positions: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary tables for even ``d``; for odd ``d`` (which the model never uses) any
    ``[B, 1, T, d]`` tables, the kernel being general in them."""
    if d % 2 == 0:
        return modeling_asm._rotary_tables(positions, d, 10000.0)
    angles = positions.to(torch.float32)[:, None, :, None] * torch.linspace(1.0, 0.01, d)
    return angles.cos(), angles.sin() * torch.where(torch.arange(d) < d // 2, -1.0, 1.0)


def to_device(y):
    if isinstance(y, tuple):
        return tuple(map(to_device, y))
    return y.to(DEVICE) if torch.is_tensor(y) else y


def make_inputs(b, t, h, k, d, steep=1.0, rotary=True, recency=True, left=None, right=None,
                seed=0) -> dict:
    """Row 0 padded on the left, row 1 on the right (``t // 3`` each unless given); position
    ids count the valid tokens, as with the tokenizer's attention mask."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.ones(b, t, dtype=torch.bool)
    left = t // 3 if left is None else left
    right = t // 3 if right is None else right
    valid[0, :left] = False
    if b > 1 and right:
        valid[1, t - right:] = False
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return dict(key=torch.randn(b, h, t, d, generator=gen) * steep,
                q=torch.randn(b, h, t, d, generator=gen),
                slot_keys=torch.randn(h, k, d, generator=gen) * d ** -0.5,
                recency=torch.rand(h, generator=gen) if recency else None,
                rotary=tables(positions, d) if rotary else None, positions=positions,
                valid=valid, write_scale=d ** -0.5 / 0.7, read_scale=d ** -0.5)


def run(fn, x: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    """Outputs and the gradients of key, q, slot_keys (and recency) for random upstream
    gradients (nonzero at the masked positions too), all in float64."""
    names = ["key", "q", "slot_keys"] + (["recency"] if x["recency"] is not None else [])
    # recency stays float32 beside bf16 inputs, as in the model (softplus(raw) * slopes)
    leaves = {n: x[n].to(DEVICE, torch.promote_types(dtype, torch.float32) if n == "recency"
                         else dtype).requires_grad_() for n in names}
    rotary = None if x["rotary"] is None else tuple(y.to(DEVICE) for y in x["rotary"])
    out = fn(leaves["key"], leaves["q"], leaves["slot_keys"], rotary, x["positions"].to(DEVICE),
             x["valid"].to(DEVICE), leaves.get("recency"), x["write_scale"], x["read_scale"])
    gen = torch.Generator().manual_seed(2)
    upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(DEVICE, o.dtype)
                for o in out]
    grads = torch.autograd.grad(out, list(leaves.values()), upstream)
    return [o.detach().double().cpu() for o in out] + [g.double().cpu() for g in grads]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict = TOL32) -> None:
    """The same infinities, and the finite entries within ``tol`` with tests/test_properties_asm's
    scaled ``atol`` (relative to magnitudes above 1: steep keys' slot-key gradients sum terms of
    ~30, whose float32 rounding exceeds 1e-5 absolute)."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite)
    assert torch.equal(actual[~finite], expected[~finite])
    assert_close_scaled(actual[finite], expected[finite], tol)


def assert_matches_reference(x: dict) -> None:
    got = run(slot_addressing_triton, x, torch.float32)
    expected = run(slot_addressing_naive, x, torch.float64)
    masked = ~x["valid"][:, None, :, None].expand_as(got[0])
    assert torch.isneginf(got[0][masked]).all() and torch.isfinite(got[0][~masked]).all()
    for a, e in zip(got, expected, strict=True):
        assert torch.isfinite(a[~masked] if a.shape == masked.shape else a).all()
        assert_close(a, e)


@pytest.mark.parametrize("recency", [False, True], ids=["no-recency", "recency"])
@pytest.mark.parametrize("rotary", [False, True], ids=["no-rotary", "rotary"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_outputs_and_every_gradient_match_float64_reference(shape, rotary, recency):
    b, t, h, k, d, steep = shape
    assert_matches_reference(make_inputs(b, t, h, k, d, steep, rotary, recency))


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


@st.composite
def small_cases(draw) -> dict:
    t = draw(st.integers(1, 40))
    return make_inputs(
        draw(st.integers(1, 2)), t, draw(st.integers(1, 3)), draw(st.integers(1, 9)),
        draw(st.integers(1, 10)), steep=draw(st.sampled_from([1.0, 30.0])),
        rotary=draw(st.booleans()), recency=draw(st.booleans()),
        left=draw(st.integers(0, t)), right=draw(st.integers(0, t)),
        seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=10, deadline=None, print_blob=True)
@given(x=small_cases())
def test_kernel_matches_float64_reference_property(x):
    """Any small shape (odd K and d, T from 1), padding, steepness, rotary and recency."""
    assert_matches_reference(x)


@pytest.mark.parametrize("rotary", [False, True], ids=["no-rotary", "rotary"])
def test_naive_equals_the_models_unfused_logits(monkeypatch, rotary):
    """The reference is what ASAAttention.forward computes (captured at its asa_attend call),
    bit for bit in float32, on the head's transposed views of q_proj / k_proj; the kernel
    equals it to the float32 tolerance."""
    torch.manual_seed(0)
    config = ASMConfig(vocab_size=31, hidden_size=32, num_attention_heads=4, num_slots=5,
                       write_temperature=0.7, recency_strength_init=0.5,
                       write_key_position="rotary" if rotary else "none")
    attn = ASAAttention(config, 0)
    attn.reset_parameters()
    b, t, h, d = 2, 11, attn.num_heads, attn.head_dim
    hidden = torch.randn(b, t, config.hidden_size)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :3] = False
    valid[1, -2:] = False
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    seen = {}

    def capture(logits, v, q, key_logits, *args, **kwargs):
        seen.update(logits=logits, key_logits=key_logits)
        return real(logits, v, q, key_logits, *args, **kwargs)

    real = modeling_asm.asa_attend
    monkeypatch.setattr(modeling_asm, "asa_attend", capture)
    with torch.no_grad():
        attn(hidden, positions, valid, backend="torch")
        q = attn.q_proj(hidden).view(b, t, h, d).transpose(1, 2)
        key = attn.k_proj(hidden).view(b, t, h, d).transpose(1, 2)
        recency = (F.softplus(attn.recency_strength_raw).to(torch.float32)
                   * attn._alibi_slopes(hidden.device, torch.float32))
        scale = d ** -0.5
        args = (key, q, attn.slot_keys,
                modeling_asm._rotary_tables(positions, d, config.rope_theta) if rotary else None,
                positions, valid, recency, scale / config.write_temperature, scale)
        naive = slot_addressing_naive(*args)
        assert torch.equal(naive[0], seen["logits"])
        assert torch.equal(naive[1], seen["key_logits"])
        fused = slot_addressing_triton(*map(to_device, args))
    for a, e in zip(fused, naive, strict=True):
        assert_close(a.cpu(), e)


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
