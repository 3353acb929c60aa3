"""ASMConfig / ASMForCausalLM: validation, Auto classes, padding, causality, decoding, save/load,
refinement interventions and statistics."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import modeling
from hf_memory.models.transformers_compat import cache_kwargs, output_cache
from modeling.asm import ASMCache, ASMConfig, ASMForCausalLM, ASMModel, RefinementStats
from modeling.asm.modeling_asm import _rotate, _StepConstants, alibi_slopes
from tests.remote_code import assert_remote_code_load_is_exact

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB = 61


def tiny_config(**overrides) -> ASMConfig:
    sizes = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                 num_slots=5, slot_space_dim=6, chunk_size=4, refinement_gate_init=0.0,
                 content_read_init=0.0, pad_token_id=0, initializer_range=0.3)
    return ASMConfig(**{**sizes, **overrides})


def tiny_model(**overrides) -> ASMForCausalLM:
    torch.manual_seed(0)
    model = ASMForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():  # make the slot keys and refinement matter at this tiny size
        for layer in model.model.layers:
            layer.self_attn.slot_keys.mul_(4.0)
    return model


def test_defaults_are_the_papers_asm_57m():
    config = ASMConfig()
    sizes = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads)
    assert sizes == (21, 384, 8)
    assert (config.num_slots, config.slot_space_dim, config.vocab_size) == (16, 32, 50257)
    assert config.model_type == "asm" and config.tie_word_embeddings
    with torch.device("meta"):
        model = ASMForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - 56.71e6) / 56.71e6 < 0.01  # the paper's ASM-57M: 56.71M parameters


@pytest.mark.parametrize(
    "field, value",
    [("vocab_size", 0), ("hidden_size", 0), ("hidden_size", 25), ("num_hidden_layers", 0),
     ("num_attention_heads", 0), ("num_slots", 0), ("slot_space_dim", 0), ("chunk_size", 0),
     ("chunk_size", 2.5), ("mlp_ratio", 0.0), ("dropout", 1.0), ("slot_dropout", -0.1),
     ("write_temperature", 0.0), ("read_temperature", -1.0), ("write_key_position", "alibi"),
     ("scan_backend", "cuda"), ("rope_theta", 0), ("recency_strength_init", 0.0),
     ("content_read_max_gamma", 0.0), ("use_content_read", 1), ("refinement_gate_init", "x"),
     ("layer_norm_eps", 0.0), ("initializer_range", -0.1), ("max_position_embeddings", 0)],
)
def test_invalid_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"ASMConfig.{field}"):
        tiny_config(**{field: value})


def test_rotary_needs_an_even_head_width():
    with pytest.raises(ValueError, match="ASMConfig.write_key_position"):
        tiny_config(hidden_size=15, num_attention_heads=3)
    assert tiny_config(hidden_size=15, num_attention_heads=3, write_key_position="none")


def test_registered_with_auto_classes_and_config_round_trip():
    for name in ("ASMConfig", "ASMModel", "ASMForCausalLM"):
        assert name in modeling.__all__
    sizes = {k: v for k, v in tiny_config().to_diff_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("asm", **sizes)
    assert isinstance(config, ASMConfig)
    assert isinstance(AutoModelForCausalLM.from_config(config), ASMForCausalLM)
    assert isinstance(AutoModel.from_config(config), ASMModel)
    again = ASMConfig.from_dict(config.to_dict())
    assert again.to_diff_dict() == config.to_diff_dict()
    assert tiny_config(custom_field=3).custom_field == 3


@pytest.mark.parametrize("variant", [{}, {"write_key_position": "none"},
                                     {"use_content_read": False},
                                     {"use_slot_space_refinement": False},
                                     {"use_recency_bias": False}],
                         ids=["full", "no-rotary", "no-content", "no-refine", "no-recency"])
def test_left_and_right_padding_match_unpadded_rows(variant):
    model = tiny_model(**variant)
    lengths = (7, 11, 1)
    rows = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    t = max(lengths)
    for side in ("left", "right"):
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        mask = torch.zeros(len(rows), t, dtype=torch.long)
        for i, row in enumerate(rows):
            sl = slice(t - len(row), t) if side == "left" else slice(0, len(row))
            ids[i, sl], mask[i, sl] = row, 1
        logits = model(ids, attention_mask=mask).logits
        assert torch.isfinite(logits).all()
        for i, row in enumerate(rows):
            single = model(row[None]).logits[0]
            real = mask[i].bool()
            torch.testing.assert_close(logits[i, real], single, **TOL)


def test_causal_and_chunk_size_invariant():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 19))
    full = model(ids).logits
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % VOCAB
    torch.testing.assert_close(model(changed).logits[:, :9], full[:, :9], **TOL)
    assert not torch.allclose(model(changed).logits[:, 9:], full[:, 9:])
    for chunk in (1, 3, 64):
        model.config.chunk_size = chunk
        torch.testing.assert_close(model(ids).logits, full, **TOL)


def test_loss_and_gradients_are_finite_with_padding():
    model = tiny_model(dropout=0.1, slot_dropout=0.2).train()
    ids = torch.randint(1, VOCAB, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB),
                                                 labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("prefill", [1, 6, 13], ids=lambda n: f"prefill{n}")
def test_prefill_then_recurrent_decode_equals_full_forward(prefill):
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded
    full = model(ids, attention_mask=mask, use_cache=False).logits
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    cache = output_cache(out)
    assert isinstance(cache, ASMCache) and cache.get_seq_length() == prefill
    pieces = [out.logits]
    for i in range(prefill, ids.shape[1]):
        step = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], **cache_kwargs(cache),
                     use_cache=True)
        pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


@pytest.mark.parametrize("variant", ["default", "padded", "authors_options", "no_refinement",
                                     "no_grad", "bare", "float64"])
def test_recurrent_decode_step_equals_reference_path(variant, monkeypatch):
    """The recurrent decode step (taken when ASMModel hands its layers the per-token constants)
    equals the chunked path on one position (the reference, taken here by withholding the
    constants): logits and every cache tensor after each of 10 tokens, with left padding,
    the authors' options (softplus-clamped gain, slot-space rotary), without refinement,
    under ``no_grad`` (where the step's weight-derived constants are made once and kept in the
    cache), without rotary, recency and content read (and read temperature 0.7), in float64."""
    overrides = {"authors_options": dict(content_gain="softplus_clamp", slot_space_rope=True),
                 "no_refinement": dict(use_slot_space_refinement=False),
                 "bare": dict(write_key_position="none", use_recency_bias=False,
                              use_content_read=False, read_temperature=0.7)}.get(variant, {})
    model = tiny_model(**overrides)
    if variant == "float64":
        model = model.double()
    ids = torch.randint(1, VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    if variant == "padded":
        mask[1, :8] = 0  # row 1 still padding during the first decoded tokens
    caches = [output_cache(model(ids[:, :3], attention_mask=mask[:, :3], use_cache=True))
              for _ in range(2)]
    with torch.set_grad_enabled(variant != "no_grad"):
        for i in range(3, ids.shape[1]):
            fast = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1],
                         **cache_kwargs(caches[0]), use_cache=True).logits
            with monkeypatch.context() as patch:
                patch.setattr(_StepConstants, "build", classmethod(lambda cls, *args: None))
                slow = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1],
                             **cache_kwargs(caches[1]), use_cache=True).logits
            torch.testing.assert_close(fast, slow, **TOL)
            for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
                for x, y in zip([a.scan.m, a.scan.den, a.scan.num, *(a.slot_space or ())],
                                [b.scan.m, b.scan.den, b.scan.num, *(b.slot_space or ())],
                                strict=True):
                    torch.testing.assert_close(x, y, **TOL)
    # kept only where no gradient is wanted; the reference path makes none
    assert all((layer.step_weights is not None) == (variant == "no_grad")
               for layer in caches[0].layers)
    assert all(layer.step_weights is None for layer in caches[1].layers)


def test_recurrent_decode_step_gradients_equal_reference_path(monkeypatch):
    """With gradients on, the decode step derives its constants from the weights anew, so a
    loss on its logits gives the weights the reference path's gradients."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 6))
    grads = []
    for fast in (True, False):
        cache = output_cache(model(ids[:, :4], use_cache=True))
        model.zero_grad()
        with monkeypatch.context() as patch:
            if not fast:
                patch.setattr(_StepConstants, "build", classmethod(lambda cls, *args: None))
            loss = sum(model(ids[:, i:i + 1], **cache_kwargs(cache), use_cache=True).logits
                       .square().mean() for i in (4, 5))
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert {"model.layers.0.self_attn.slot_keys", "model.layers.1.self_attn.refinement_gate_raw",
            "model.layers.0.self_attn.recency_strength_raw",
            "model.layers.0.self_attn.content_gamma_raw"} <= grads[0].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], **TOL, msg=name)


def test_decode_step_weights_belong_to_their_cache(monkeypatch):
    """The constants a ``no_grad`` decode keeps in its cache are made from the weights at its
    first step: weights changed in place afterwards reach every new cache (and ``reset``
    drops them)."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 8))
    with torch.no_grad():
        cache = output_cache(model(ids[:, :4], use_cache=True))
        model(ids[:, 4:5], **cache_kwargs(cache), use_cache=True)
        assert cache.layers[0].step_weights is not None
        for layer in model.model.layers:
            layer.self_attn.slot_keys.mul_(-1.5)
            layer.self_attn.refinement_gate_raw.add_(1.0)
            layer.self_attn.recency_strength_raw.add_(0.5)
        outs = []
        for fast in (True, False):
            cache = output_cache(model(ids[:, :4], use_cache=True))
            with monkeypatch.context() as patch:
                if not fast:
                    patch.setattr(_StepConstants, "build", classmethod(lambda cls, *args: None))
                outs.append(torch.cat([model(ids[:, i:i + 1], **cache_kwargs(cache),
                                             use_cache=True).logits for i in range(4, 8)], 1))
        torch.testing.assert_close(outs[0], outs[1], **TOL)
    cache.reset()
    assert all(layer.step_weights is None for layer in cache.layers)


def test_recency_strength_4_prefill_equals_decode_and_chunk_1():
    """Issue 15: with recency strength 4 the first of 8 heads' write logits rise by 2 per
    token, more than float32's exponent range inside a chunk of 64 (the old chunked scan gave
    NaN). Prefill at chunk 64 is finite and equals chunk 1 and prefill + token-by-token decode,
    with a left-padded row."""
    model = tiny_model(num_attention_heads=8, hidden_size=32, recency_strength_init=4.0,
                       chunk_size=64)
    ids = torch.randint(1, VOCAB, (2, 75))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    full = model(ids, attention_mask=mask, use_cache=False).logits
    assert torch.isfinite(full).all()
    model.config.chunk_size = 1
    torch.testing.assert_close(model(ids, attention_mask=mask, use_cache=False).logits, full,
                               **TOL)
    model.config.chunk_size = 64
    out = model(ids[:, :70], attention_mask=mask[:, :70], use_cache=True)
    pieces = [out.logits]
    for i in range(70, ids.shape[1]):
        pieces.append(model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1],
                            **cache_kwargs(output_cache(out)), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


def test_decode_state_does_not_grow_with_length():
    model = tiny_model()
    cache = output_cache(model(torch.randint(1, VOCAB, (1, 5)), use_cache=True))
    size = cache.state_bytes()
    c = model.config
    per_layer = 4 * c.num_attention_heads * (2 * c.num_slots + c.num_slots * c.head_dim
                                             + c.slot_space_dim ** 2 + c.slot_space_dim)
    assert size == c.num_hidden_layers * per_layer
    for token in torch.randint(1, VOCAB, (40,)):
        model(token.view(1, 1), **cache_kwargs(cache), use_cache=True)
    assert cache.state_bytes() == size and cache.get_seq_length() == 45


def test_generate_with_cache_equals_greedy_without_cache():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    manual = ids.clone()
    manual_mask = mask.clone()
    for _ in range(12):
        nxt = model(manual, attention_mask=manual_mask, use_cache=False).logits[:, -1].argmax(-1)
        manual = torch.cat([manual, nxt[:, None]], dim=1)
        manual_mask = torch.cat([manual_mask, torch.ones_like(nxt[:, None])], dim=1)
    assert torch.equal(cached, manual)


def test_cache_reorders_and_repeats_for_beams():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 5))
    cache = output_cache(model(ids, use_cache=True))
    cache.batch_repeat_interleave(2)
    cache.reorder_cache(torch.tensor([3, 2, 1, 0]))
    nxt = torch.randint(1, VOCAB, (4, 1))
    step = model(nxt, **cache_kwargs(cache), use_cache=True).logits
    expected = model(torch.cat([ids.repeat_interleave(2, 0)[[3, 2, 1, 0]], nxt], 1)).logits
    torch.testing.assert_close(step[:, -1], expected[:, -1], **TOL)
    with pytest.raises(NotImplementedError):
        cache.crop(1)


def test_save_pretrained_round_trip(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == {"AutoConfig": "configuration_asm.ASMConfig",
                                 "AutoModelForCausalLM": "modeling_asm.ASMForCausalLM"}
    assert {"configuration_asm.py", "modeling_asm.py", "asm_ops.py", "asm_common.py",
            "asm_chunk.py", "asm_chunk_autograd.py", "asm_recurrent.py", "asm_fused_recurrent.py",
            "asm_triton_chunk.py",
            "model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    assert not (tmp_path / "asm_naive.py").exists()  # the references stay out of the Hub folder
    loaded = ASMForCausalLM.from_pretrained(tmp_path).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.slow
def test_auto_model_with_remote_code_offline_in_a_subprocess(tmp_path):
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 9))
    assert assert_remote_code_load_is_exact(
        model, ids, tmp_path, auto_class="AutoModelForCausalLM") == "ASMForCausalLM"


def layer_outputs(model: ASMForCausalLM, mode: str, beta: float = 1.0) -> torch.Tensor:
    """First ASA layer's output ``[B, T, D]`` on fixed inputs under an intervention."""
    torch.manual_seed(5)
    hidden = torch.randn(2, 11, model.config.hidden_size)
    positions = torch.arange(11).expand(2, 11)
    valid = torch.ones(2, 11, dtype=torch.bool)
    with model.refinement_intervention(mode, beta=beta):
        return model.model.layers[0].self_attn(hidden, positions, valid)[0]


def test_interventions_parallel_plus_orthogonal_is_full():
    model = tiny_model()
    full = layer_outputs(model, "default")
    par = layer_outputs(model, "parallel_only")
    orth = layer_outputs(model, "orthogonal_only")
    none = layer_outputs(model, "none")
    torch.testing.assert_close(par + orth, full + none, **TOL)
    assert not torch.allclose(par, full) and not torch.allclose(orth, full)
    torch.testing.assert_close(layer_outputs(model, "orthogonal_scaled", beta=0.0), par, **TOL)
    torch.testing.assert_close(layer_outputs(model, "orthogonal_scaled", beta=1.0), full, **TOL)
    torch.testing.assert_close(layer_outputs(model, "parallel_scaled", beta=0.0), orth, **TOL)
    half = layer_outputs(model, "orthogonal_scaled", beta=0.5)
    torch.testing.assert_close(half, 0.5 * (par + full), **TOL)


def test_default_intervention_is_no_intervention_and_context_restores():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 9))
    plain = model(ids).logits
    with model.refinement_intervention("default"):
        assert torch.equal(model(ids).logits, plain)
    with pytest.raises(RuntimeError), model.refinement_intervention("orthogonal_only"):
        assert not torch.allclose(model(ids).logits, plain)
        raise RuntimeError("restored even on exceptions")
    assert torch.equal(model(ids).logits, plain)
    with pytest.raises(ValueError, match="mode"):
        model.set_refinement_intervention("sideways")
    with pytest.raises(ValueError, match="layers"):
        model.set_refinement_intervention("none", layers=[2])


def test_interventions_per_layer_and_head():
    model = tiny_model()
    model.set_refinement_intervention("orthogonal_scaled", beta=0.25, layers=[1], heads=[0, 2])
    attn = [layer.self_attn for layer in model.model.layers]
    assert attn[0].intervention == ([1.0] * 3, [1.0] * 3)
    assert attn[1].intervention == ([1.0] * 3, [0.25, 1.0, 0.25])
    ids = torch.randint(0, VOCAB, (1, 9))
    out = model(ids, output_hidden_states=True)
    model.set_refinement_intervention("default")
    ref = model(ids, output_hidden_states=True)
    assert torch.equal(out.hidden_states[1], ref.hidden_states[1])  # layer 0 untouched
    assert not torch.allclose(out.hidden_states[2], ref.hidden_states[2])


def test_refinement_statistics():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 13))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    plain = model(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask, output_refinement_stats=True)
    torch.testing.assert_close(out.logits, plain, **TOL)  # statistics do not change the output
    assert len(out.refinement_stats) == 2
    b, h, t, k = 2, 3, 13, 5
    for stats in out.refinement_stats:
        assert isinstance(stats, RefinementStats)
        real = stats.mask[:, None, :].expand(b, h, t)
        for x in (stats.alpha, stats.orthogonal_fraction, stats.relative_magnitude,
                  stats.slot_ess):
            assert x.shape == (b, h, t) and torch.isfinite(x[real]).all()
        assert ((stats.orthogonal_fraction[real] >= 0) & (stats.orthogonal_fraction[real]
                                                          <= 1 + 1e-6)).all()
        assert ((stats.slot_ess[real] >= 1 - 1e-6) & (stats.slot_ess[real] <= k + 1e-6)).all()
        assert stats.routing_inertia.shape == (b, h)
        assert ((stats.routing_inertia >= 0) & (stats.routing_inertia <= 1 + 1e-6)).all()
        assert stats.slot_write_half_life.shape == (b, h, k)
        assert (stats.slot_write_half_life >= 1).all()
        assert (stats.slot_write_half_life <= stats.mask.sum(1)[:, None, None]).all()


def test_half_life_by_hand():
    """Hand-checked statistics on one head: the write mass of slot s at the last position is
    softmax over the real tokens; the half-life counts the newest tokens holding half of it."""
    model = tiny_model(num_attention_heads=1, hidden_size=8, num_hidden_layers=1)
    ids = torch.randint(1, VOCAB, (1, 10))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    attn = model.model.layers[0].self_attn
    stats = model(ids, attention_mask=mask, output_refinement_stats=True).refinement_stats[0]
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        key = attn.k_proj(hidden).view(1, 10, 1, 8).transpose(1, 2)
        key = _rotate(key, positions, model.config.rope_theta)
        logits = torch.einsum("bhtd,hkd->bhtk", key, attn.slot_keys) * 8 ** -0.5
        strength = torch.nn.functional.softplus(attn.recency_strength_raw)
        logits = logits + strength * alibi_slopes(1)[0] * positions[:, None, :, None]
    for s in range(5):
        w = torch.softmax(logits[0, 0, 2:, s], dim=0).flip(0)
        expected = int((w.cumsum(0) >= 0.5).nonzero()[0]) + 1
        assert int(stats.slot_write_half_life[0, 0, s]) == expected


def test_bfloat16_model_runs_with_float32_state_and_rejects_4d_masks():
    model = tiny_model().to(torch.bfloat16)
    ids = torch.randint(1, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = model(ids, attention_mask=mask, use_cache=True)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
    layer = output_cache(out).layers[0]
    assert layer.scan.num.dtype == torch.float32 and layer.slot_space[0].dtype == torch.float32
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 1, 7, 7))
