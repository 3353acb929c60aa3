"""ASMConfig fidelity options matching the ASA authors' public code: the content-read gain
(``content_gain``) and the rotary map in slot space (``slot_space_rope``). Defaults leave the
model bit-identical; the options keep decoding, padding, chunking and save/load exact."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_memory.models.transformers_compat import cache_kwargs, output_cache
from modeling.asm import ASMConfig, ASMForCausalLM
from modeling.asm.modeling_asm import _rotate

VOCAB = 61
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}
ROPE = dict(slot_space_rope=True)
AUTHORS = dict(content_gain="softplus_clamp", slot_space_rope=True)


def tiny_config(**overrides) -> ASMConfig:
    sizes = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                 num_slots=5, slot_space_dim=6, chunk_size=4, refinement_gate_init=0.0,
                 content_read_init=0.0, pad_token_id=0, initializer_range=0.3)
    return ASMConfig(**{**sizes, **overrides})


def tiny_model(dtype: torch.dtype = torch.float32, **overrides) -> ASMForCausalLM:
    """Seeded tiny model; the same seed gives the same weights whatever the options (none of
    them adds or removes a parameter)."""
    torch.manual_seed(0)
    model = ASMForCausalLM(tiny_config(**overrides)).eval().to(dtype)
    with torch.no_grad():  # make the slot keys and refinement matter at this tiny size
        for layer in model.model.layers:
            layer.self_attn.slot_keys.mul_(4.0)
    return model


def padded_batch(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, row in enumerate(rows):
        sl = slice(t - len(row), t) if side == "left" else slice(0, len(row))
        ids[i, sl], mask[i, sl] = row, 1
    return ids, mask


# ---- defaults ---------------------------------------------------------------------------------


def test_defaults_are_sigmoid_gain_and_no_slot_space_rope():
    config = ASMConfig()
    assert config.content_gain == "sigmoid"
    assert config.slot_space_rope is False
    assert config.slot_space_rope_theta == 100000.0


def test_default_logits_are_bit_identical_to_the_options_spelled_out():
    ids = torch.randint(1, VOCAB, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    plain = tiny_model()(ids, attention_mask=mask).logits
    spelled = tiny_model(content_gain="sigmoid", slot_space_rope=False,
                         slot_space_rope_theta=100000.0)
    assert torch.equal(spelled(ids, attention_mask=mask).logits, plain)
    # the theta is unused without slot_space_rope
    other_theta = tiny_model(slot_space_rope_theta=7.0)
    assert torch.equal(other_theta(ids, attention_mask=mask).logits, plain)


# ---- content_gain -----------------------------------------------------------------------------


def softplus_clamp_by_hand(raw: float, max_gamma: float) -> float:
    return min(math.log1p(math.exp(raw)), max_gamma)


@pytest.mark.parametrize("raw", [-4.0, 0.0, 1.5, 2.9, 2.95, 3.0, 10.0],
                         ids=lambda r: f"raw{r:g}")
def test_softplus_clamp_gamma_by_hand(raw):
    """softplus(2.9) = 2.954 < 3 < softplus(2.95) = 3.0019: the clamp point lies between."""
    attn = tiny_model(torch.float64, content_gain="softplus_clamp").model.layers[0].self_attn
    with torch.no_grad():
        attn.content_gamma_raw.fill_(raw)
    expected = softplus_clamp_by_hand(raw, 3.0)
    assert attn.gamma.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # gradient: d softplus / d raw = sigmoid(raw) below the clamp, zero above it
    (grad,) = torch.autograd.grad(attn.gamma, attn.content_gamma_raw)
    clamped = math.log1p(math.exp(raw)) > 3.0
    expected_grad = 0.0 if clamped else 1.0 / (1.0 + math.exp(-raw))
    assert grad.item() == pytest.approx(expected_grad, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("raw", [-4.0, 0.0, 3.0], ids=lambda r: f"raw{r:g}")
def test_sigmoid_gamma_by_hand(raw):
    attn = tiny_model(torch.float64).model.layers[0].self_attn
    with torch.no_grad():
        attn.content_gamma_raw.fill_(raw)
    assert attn.gamma.item() == pytest.approx(3.0 / (1.0 + math.exp(-raw)), rel=1e-12)


def test_softplus_clamp_respects_content_read_max_gamma():
    attn = tiny_model(torch.float64, content_gain="softplus_clamp",
                      content_read_max_gamma=0.5).model.layers[0].self_attn
    with torch.no_grad():
        attn.content_gamma_raw.fill_(0.0)  # softplus(0) = ln 2 > 0.5
    assert attn.gamma.item() == 0.5


def test_softplus_clamp_changes_the_logits():
    ids = torch.randint(1, VOCAB, (2, 11))
    sigmoid = tiny_model()(ids).logits
    softplus = tiny_model(content_gain="softplus_clamp")(ids).logits
    assert torch.isfinite(softplus).all()
    assert not torch.allclose(softplus, sigmoid)
    # without the content read, the gain does not matter
    off = tiny_model(use_content_read=False)(ids).logits
    assert torch.equal(tiny_model(use_content_read=False, content_gain="softplus_clamp")(ids)
                       .logits, off)


# ---- slot_space_rope --------------------------------------------------------------------------


def test_slot_space_rope_changes_the_logits_only_through_the_refinement():
    ids = torch.randint(1, VOCAB, (2, 11))
    plain = tiny_model()(ids).logits
    rope = tiny_model(**ROPE)(ids).logits
    assert torch.isfinite(rope).all()
    assert not torch.allclose(rope, plain)
    # the first position is rotated by angle 0: unchanged up to rounding
    torch.testing.assert_close(rope[:, 0], plain[:, 0], **TOL[torch.float32])
    # a different base changes the result
    assert not torch.allclose(tiny_model(slot_space_rope_theta=10.0, **ROPE)(ids).logits, rope)
    # without the refinement there is nothing to rotate
    no_refine = tiny_model(use_slot_space_refinement=False)(ids).logits
    assert torch.equal(tiny_model(use_slot_space_refinement=False, **ROPE)(ids).logits,
                       no_refine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("options", [ROPE, AUTHORS], ids=["rope", "authors"])
@pytest.mark.parametrize("prefill", [1, 6, 13], ids=lambda n: f"prefill{n}")
def test_slot_space_rope_prefill_then_decode_equals_full_forward(prefill, options, dtype):
    model = tiny_model(dtype, **options)
    ids = torch.randint(1, VOCAB, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded
    full = model(ids, attention_mask=mask, use_cache=False).logits
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    cache = output_cache(out)
    pieces = [out.logits]
    for i in range(prefill, ids.shape[1]):
        step = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], **cache_kwargs(cache),
                     use_cache=True)
        pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL[dtype])


@pytest.mark.parametrize("options", [ROPE, AUTHORS], ids=["rope", "authors"])
def test_slot_space_rope_generate_with_cache_equals_greedy_without(options):
    model = tiny_model(**options)
    ids = torch.randint(1, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, **kwargs)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))
    manual, manual_mask = ids.clone(), mask.clone()
    for _ in range(12):
        nxt = model(manual, attention_mask=manual_mask, use_cache=False).logits[:, -1].argmax(-1)
        manual = torch.cat([manual, nxt[:, None]], dim=1)
        manual_mask = torch.cat([manual_mask, torch.ones_like(nxt[:, None])], dim=1)
    assert torch.equal(cached, manual)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("options", [ROPE, AUTHORS], ids=["rope", "authors"])
def test_slot_space_rope_padding_matches_unpadded_rows(options, side):
    model = tiny_model(**options)
    rows = [torch.randint(1, VOCAB, (n,)) for n in (7, 11, 1)]
    ids, mask = padded_batch(rows, side)
    logits = model(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    for i, row in enumerate(rows):
        torch.testing.assert_close(logits[i, mask[i].bool()], model(row[None]).logits[0],
                                   **TOL[torch.float32])


@pytest.mark.parametrize("options", [ROPE, AUTHORS], ids=["rope", "authors"])
def test_slot_space_rope_chunk_size_1_equals_whole_sequence(options):
    model = tiny_model(**options)
    ids = torch.randint(1, VOCAB, (2, 19))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    results = {}
    for chunk in (1, 4, ids.shape[1]):
        model.config.chunk_size = chunk
        results[chunk] = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(results[1], results[ids.shape[1]], **TOL[torch.float32])
    torch.testing.assert_close(results[4], results[ids.shape[1]], **TOL[torch.float32])


@settings(max_examples=30, deadline=None, print_blob=True)
@given(b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 9), half=st.integers(1, 8),
       theta=st.sampled_from([10.0, 10000.0, 100000.0]), start=st.integers(0, 5000),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2 ** 16))
def test_rotation_preserves_norms(b, h, t, half, theta, start, dtype, seed):
    """``_rotate`` (the slot-space map) keeps every vector's norm at any position, to float32
    precision: its cos and sin are computed in float32, also for float64 inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, 2 * half, generator=gen, dtype=dtype)
    positions = start + torch.randint(0, 50, (b, t), generator=gen)
    torch.testing.assert_close(_rotate(x, positions, theta).norm(dim=-1), x.norm(dim=-1),
                               rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None, print_blob=True)
@given(t=st.integers(1, 9), half=st.integers(1, 8), shift=st.integers(0, 20),
       theta=st.sampled_from([10.0, 10000.0, 100000.0]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2 ** 16))
def test_rotation_inner_products_depend_on_relative_position(t, half, shift, theta, dtype, seed):
    """``<rot(p) x, rot(p + shift) y> = <x, rot(shift) y>`` for every ``p``. Unit vectors and
    ``p < 64``: the angles are computed in float32 (also for float64 inputs), so their rounding,
    ~4e-6 rad here, sets the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(1, 1, t, 2 * half, generator=gen,
                                                  dtype=dtype), dim=-1)
    y = torch.nn.functional.normalize(torch.randn(1, 1, t, 2 * half, generator=gen,
                                                  dtype=dtype), dim=-1)
    positions = torch.randint(0, 40, (1, t), generator=gen)
    lhs = (_rotate(x, positions, theta) * _rotate(y, positions + shift, theta)).sum(-1)
    rhs = (x * _rotate(y, torch.full_like(positions, shift), theta)).sum(-1)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=2e-5)


def authors_apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The authors' map (interleaved ``_rotate_half`` with half-split ``cat(freqs, freqs)``)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    rotated_half = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * emb.cos() + rotated_half * emb.sin()


def test_the_authors_map_is_not_a_rotation_ours_is():
    """Why we do not copy the authors' layout: pairs ``(2j, 2j+1)`` are mixed with the angles of
    frequencies ``2j mod M/2`` and ``2j+1 mod M/2``, so the map is not orthogonal."""
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    positions = torch.tensor([5])
    theirs = authors_apply_rope(x, positions, 100000.0)
    ours = _rotate(x[None, None], positions[None], 100000.0)[0, 0]
    assert ours.norm().item() == pytest.approx(1.0, rel=1e-6)  # float32 angles
    assert abs(theirs.norm().item() - 1.0) > 0.5  # 0.30: cos(5) and sin(5 * 1e5 ** (-1/3))


# ---- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [(dict(content_gain="softplus"), "content_gain"),
     (dict(content_gain=None), "content_gain"),
     (dict(slot_space_rope=True, slot_space_dim=5), "slot_space_rope"),
     (dict(slot_space_rope=1), "slot_space_rope"),
     (dict(slot_space_rope_theta=0.0), "slot_space_rope_theta"),
     (dict(slot_space_rope_theta=-100000.0), "slot_space_rope_theta"),
     (dict(slot_space_rope_theta="big"), "slot_space_rope_theta")],
    ids=["unknown-gain", "none-gain", "odd-slot-space-dim", "rope-not-bool", "theta-zero",
         "theta-negative", "theta-string"],
)
def test_invalid_fidelity_options_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"ASMConfig.{field}"):
        tiny_config(**overrides)


def test_odd_slot_space_dim_is_fine_without_rope():
    assert tiny_config(slot_space_dim=5).slot_space_dim == 5


def test_save_pretrained_round_trip_keeps_the_options_and_logits(tmp_path):
    model = tiny_model(slot_space_rope_theta=5000.0, **AUTHORS)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["content_gain"] == "softplus_clamp"
    assert saved["slot_space_rope"] is True and saved["slot_space_rope_theta"] == 5000.0
    loaded = ASMForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.content_gain == "softplus_clamp"
    assert loaded.config.slot_space_rope is True
    assert loaded.config.slot_space_rope_theta == 5000.0
    ids = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_config_without_the_options_loads_with_the_defaults(tmp_path):
    """A config.json written before the options existed loads as the paper's formulas."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    for key in ("content_gain", "slot_space_rope", "slot_space_rope_theta"):
        saved.pop(key, None)
    path.write_text(json.dumps(saved))
    loaded = ASMForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.content_gain, loaded.config.slot_space_rope) == ("sigmoid", False)
    ids = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_authors_options_on_the_triton_backend_equal_torch():
    """The rotary map lives in the refinement closure, which every scan backend calls (Triton
    under ``TRITON_INTERPRET=1`` on CPU, set by conftest)."""
    pytest.importorskip("triton")
    model = tiny_model(num_hidden_layers=1, **AUTHORS)
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    expected = model(ids, attention_mask=mask, use_cache=False).logits
    model.config.scan_backend = "triton"
    out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
    step = model(ids[:, 6:], attention_mask=mask, **cache_kwargs(output_cache(out)),
                 use_cache=True)
    torch.testing.assert_close(torch.cat([out.logits, step.logits], dim=1), expected,
                               **TOL[torch.float32])
