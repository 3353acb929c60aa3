"""The slot addressing of an ASA layer (issue 81): the PyTorch form the model runs on the CPU
against the float64 reference (outputs and every gradient), the model's own logits against the
reference, and the dispatcher's choice. The Triton kernel's own tests
(tests/test_asm_triton_addressing.py) share this file's inputs and checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modeling.asm import ASAAttention, ASMConfig, asm_ops, modeling_asm
from modeling.asm.asm_addressing import slot_addressing_torch
from modeling.asm.asm_naive import slot_addressing_naive
from tests.test_properties_asm import TOL32
from tests.test_properties_asm import assert_close as assert_close_scaled

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


def assert_matches_reference(x: dict, form) -> None:
    got = run(form, x, torch.float32)
    expected = run(slot_addressing_naive, x, torch.float64)
    masked = ~x["valid"][:, None, :, None].expand_as(got[0])
    assert torch.isneginf(got[0][masked]).all() and torch.isfinite(got[0][~masked]).all()
    for a, e in zip(got, expected, strict=True):
        assert torch.isfinite(a[~masked] if a.shape == masked.shape else a).all()
        assert_close(a, e)



@pytest.mark.parametrize("recency", [False, True], ids=["no-recency", "recency"])
@pytest.mark.parametrize("rotary", [False, True], ids=["no-rotary", "rotary"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_torch_form_outputs_and_every_gradient_match_float64_reference(shape, rotary, recency):
    b, t, h, k, d, steep = shape
    assert_matches_reference(make_inputs(b, t, h, k, d, steep, rotary, recency),
                             slot_addressing_torch)


@st.composite
def small_cases(draw) -> dict:
    t = draw(st.integers(1, 40))
    return make_inputs(
        draw(st.integers(1, 2)), t, draw(st.integers(1, 3)), draw(st.integers(1, 9)),
        draw(st.integers(1, 10)),
        steep=draw(st.sampled_from([1.0, 30.0])), rotary=draw(st.booleans()),
        recency=draw(st.booleans()), left=draw(st.integers(0, t)),
        right=draw(st.integers(0, t)), seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=25, deadline=None, print_blob=True)
@given(x=small_cases())
def test_torch_form_matches_float64_reference_property(x):
    """Any small shape (odd K and d, T from 1), padding, steepness, rotary and recency."""
    assert_matches_reference(x, slot_addressing_torch)


def model_case(rotary: bool):
    """A small ASA layer, a padded batch (left and right), and the arguments its forward gives
    the slot addressing, built from its own projections."""
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
    with torch.no_grad():
        q = attn.q_proj(hidden).view(b, t, h, d).transpose(1, 2)
        key = attn.k_proj(hidden).view(b, t, h, d).transpose(1, 2)
        recency = (torch.nn.functional.softplus(attn.recency_strength_raw)
                   * attn._alibi_slopes(hidden.device, torch.float32))
    scale = d ** -0.5
    args = (key, q, attn.slot_keys.detach(),
            modeling_asm._rotary_tables(positions, d, config.rope_theta) if rotary else None,
            positions, valid, recency, scale / config.write_temperature, scale)
    return attn, hidden, positions, valid, args


def captured_logits(monkeypatch, attn, hidden, positions, valid, backend: str):
    """The logits ``ASAAttention.forward`` hands the scan, captured at its asa_attend call."""
    seen = {}
    real = modeling_asm.asa_attend

    def capture(logits, v, q, key_logits, *args, **kwargs):
        seen.update(logits=logits, key_logits=key_logits)
        return real(logits, v, q, key_logits, *args, **kwargs)

    monkeypatch.setattr(modeling_asm, "asa_attend", capture)
    with torch.no_grad():
        attn(hidden, positions, valid, backend=backend)
    monkeypatch.undo()
    return seen["logits"], seen["key_logits"]


@pytest.mark.parametrize("rotary", [False, True], ids=["no-rotary", "rotary"])
def test_the_models_logits_are_the_reference(monkeypatch, rotary):
    """What ASAAttention.forward computes on the PyTorch backend (its fused q/k/v product, the
    fused addressing) equals the unfused definition run in float64, to the float32
    tolerance, padding on both sides."""
    attn, hidden, positions, valid, args = model_case(rotary)
    got = captured_logits(monkeypatch, attn, hidden, positions, valid, "torch")
    expected = slot_addressing_naive(*[a.double() if torch.is_tensor(a) and a.is_floating_point()
                                       else a for a in args[:3]], *args[3:])
    for a, e in zip(got, expected, strict=True):
        assert_close(a.double(), e)


def test_the_dispatcher_takes_the_pytorch_form_off_triton(monkeypatch):
    """On the PyTorch backend the dispatcher runs slot_addressing_torch (and never the
    kernel); a backend name it does not know is refused by name."""
    calls = []
    monkeypatch.setattr(asm_ops, "slot_addressing_triton", lambda *a: calls.append("triton"))
    _, _, _, _, args = model_case(True)
    out = asm_ops.slot_addressing(*args, backend="torch")
    for a, e in zip(out, slot_addressing_torch(*args), strict=True):
        assert torch.equal(a, e)
    assert not calls
    with pytest.raises(ValueError, match="backend must be one of"):
        asm_ops.slot_addressing(*args, backend="cuda")
