"""Memory inception exactness on the tiny models of every supported family (float64)."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_memory import (
    BankSet,
    MemoryBank,
    UnsupportedModelError,
    steer,
    steered_generate,
)
from hf_memory.banks.capture import capture_kv
from hf_memory.models.adapters import get_adapter
from hf_memory.models.transformers_compat import cache_kwargs
from tests.tiny_models import FAMILIES, tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

FAMILY_IDS = list(FAMILIES)
KVH, HEADS, D, LAYERS = 2, 4, 16, 3
TOL = dict(rtol=1e-10, atol=1e-10)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}  # attention_scaling != 1


def random_bank(name, role, slots, *, layers=(0, 1, 2), gain=1.0, seed=0, **extra):
    generator = torch.Generator().manual_seed(seed)
    shape = (len(layers), KVH, slots, D)
    return MemoryBank.from_tensors(
        torch.randn(shape, generator=generator, dtype=torch.float64) * 2,
        torch.randn(shape, generator=generator, dtype=torch.float64),
        name=name, role=role, layers=layers, gain=gain, **extra)


def token_ids(batch=2, length=9, seed=1):
    return torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_restored(model, implementation="sdpa"):
    adapter = get_adapter(model)
    assert model.config._attn_implementation == implementation
    assert not model._forward_pre_hooks and not model._forward_hooks
    for layer in range(model.config.num_hidden_layers):
        attention = adapter.attention(model, layer)
        assert not getattr(attention, adapter.query_module)._forward_hooks


# -- an independent reference: one softmax over [prompt keys ; bank keys] with explicit repeat-KV


class ConcatReference:
    """Registers an attention function computing appendix G.1's concatenated softmax."""

    name = "test_mi_concat_reference"

    def __init__(self, model, banks, sites, *, rho, gamma, size_normalize=True):
        self.model, self.banks, self.sites = model, banks, sites
        self.rho, self.gamma, self.size_normalize = rho, gamma, size_normalize
        self.queries = {}
        adapter = get_adapter(model)
        self.hooks = []
        for layer in sites:
            module = getattr(adapter.attention(model, layer), adapter.query_module)
            self.hooks.append(module.register_forward_hook(
                lambda _m, _a, out, layer=layer: self.queries.__setitem__(layer, out)))
        AttentionInterface.register(self.name, self.attention)
        AttentionMaskInterface.register(self.name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])

    def stock(self, module, query, key, value, attention_mask, **kwargs):
        """What the model's own attention computes (the unsteered heads), ``[B, T, H, D]``."""
        function = (ALL_ATTENTION_FUNCTIONS["sdpa"] if self.original == "sdpa"
                    else sys.modules[type(module).__module__].eager_attention_forward)
        return function(module, query, key, value, attention_mask, scaling=module.scaling,
                        **kwargs)[0]

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, h, t, d = query.shape
        plain = self.stock(module, query, key, value, attention_mask, **kwargs)
        group = h // key.shape[1]
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
        softcap = kwargs.get("softcap")
        cap = (lambda s: s) if softcap is None else (lambda s: torch.tanh(s / softcap) * softcap)
        scores = cap(query @ key.transpose(-1, -2) * module.scaling)
        visible = attention_mask[..., : key.shape[2]] == 0
        scores = scores.masked_fill(~visible, -math.inf)
        layer = module.layer_idx
        if layer not in self.sites:
            return plain, None
        q_pre = get_adapter(self.model).query(self.queries[layer], self.model.config)
        count = visible.sum(-1, keepdim=True).to(scores.dtype).expand(b, h, t, 1)
        columns = [scores - (count.log() if self.size_normalize else 0)]
        values = [value]
        log_mean = {}
        for bank in self.banks:
            keys = bank.keys[bank.layers.index(layer)].repeat_interleave(group, dim=0)
            s = cap(torch.einsum("bhtd,hmd->bhtm", q_pre, keys) * module.scaling)
            log_mean[bank.role] = torch.logsumexp(s, -1, keepdim=True) - math.log(bank.num_slots)
            columns.append(s - (math.log(bank.num_slots) if self.size_normalize else 0))
            values.append(bank.values[bank.layers.index(layer)].repeat_interleave(group, dim=0)
                          .expand(b, h, -1, -1))
        gap = log_mean["target"] - log_mean["reference"]
        for i, bank in enumerate(self.banks, start=1):
            if bank.role == "target":
                columns[i] = columns[i] + self.rho * bank.gain * torch.sigmoid(self.gamma * gap)
            elif bank.role == "reference":
                columns[i] = columns[i] - self.rho * bank.gain * torch.sigmoid(-self.gamma * gap)
            else:
                columns[i] = columns[i] + self.rho * bank.gain
        weights = torch.softmax(torch.cat(columns, -1), -1)
        mixed = weights @ torch.cat(values, dim=2)
        heads = torch.zeros(h, dtype=torch.bool, device=scores.device)
        heads[self.sites[layer]] = True
        return torch.where(heads[None, None, :, None], mixed.transpose(1, 2), plain), None

    def __enter__(self):
        self.original = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.name)
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        self.model.set_attn_implementation(self.original)
        # leave transformers' global registries as they were
        AttentionInterface._global_mapping.pop(self.name, None)
        AttentionMaskInterface._global_mapping.pop(self.name, None)


# -- contract: inactive or empty steering is bit-identical, and the model is restored


@pytest.mark.parametrize("family, attn", [(f, a) for f in FAMILY_IDS for a in ("sdpa", "eager")
                                          if (f, a) != ("gemma2", "sdpa")])  # gemma2: no SDPA
def test_empty_steering_is_bit_identical_and_restored(family, attn):
    model = tiny_model(family, attn=attn)
    ids = token_ids()
    plain = model(ids).logits
    with steer(model, []) as handle:
        assert model.config._attn_implementation == f"hf_memory_{attn}"
        assert torch.equal(model(ids).logits, plain)
        assert handle.active_sites == {}
    bank = random_bank("t", "target", 5, layers=(1,))
    with steer(model, [bank], layers=[0, 2]):  # sites the bank does not cover: inactive
        assert torch.equal(model(ids).logits, plain)
    assert_restored(model, attn)
    assert torch.equal(model(ids).logits, plain)


def test_model_is_restored_after_an_exception():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="boom"), steer(model, [random_bank("t", "target", 3)]):
        raise RuntimeError("boom")
    assert_restored(model)


def test_handle_remove_restores_and_is_idempotent():
    model = tiny_model("llama")
    ids = token_ids()
    plain = model(ids).logits
    handle = steer(model, [random_bank("t", "target", 3)])
    assert not torch.equal(model(ids).logits, plain)
    handle.remove()
    handle.remove()
    assert_restored(model)
    assert torch.equal(model(ids).logits, plain)
    with pytest.raises(RuntimeError, match="removed"):
        handle.update([])


# -- the mixture equals one softmax over concatenated keys (appendix G.1)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_steered_logits_equal_concatenated_softmax_reference(family):
    model = tiny_model(family)
    banks = [random_bank("t", "target", 5, gain=1.5, seed=1),
             random_bank("r", "reference", 3, gain=0.7, seed=2),
             random_bank("aux", "auxiliary", 4, gain=0.4, seed=3)]
    sites = {1: [0, 3], 2: [1, 2, 3]}
    ids = token_ids()
    with steer(model, BankSet(banks, gamma=1.3), units=sites, layer_gains={1: 0.8, 2: 0.8}):
        steered = model(ids).logits
    with ConcatReference(model, banks, sites, rho=0.8, gamma=1.3):
        expected = model(ids).logits
    torch.testing.assert_close(steered, expected, **TOL)
    assert not torch.allclose(steered, model(ids).logits, atol=1e-3), "steering had no effect"


def test_unnormalized_mixture_is_plain_concatenated_attention():
    model = tiny_model("llama")
    banks = [random_bank("t", "target", 6, gain=0.0), random_bank("r", "reference", 2, gain=0.0)]
    sites = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [0, 1, 2, 3]}
    ids = token_ids()
    with steer(model, BankSet(banks, size_normalize=False)):
        steered = model(ids).logits
    with ConcatReference(model, banks, sites, rho=1.0, gamma=1.0, size_normalize=False):
        expected = model(ids).logits
    torch.testing.assert_close(steered, expected, **TOL)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_kv_group_unit_equals_its_query_heads(family):
    model = tiny_model(family)
    bank = [random_bank("t", "target", 5)]
    ids = token_ids()
    with steer(model, bank, units=[1], unit_type="kv_group") as handle:
        by_group = model(ids).logits
        assert handle.active_sites == {0: [2, 3], 1: [2, 3], 2: [2, 3]}
    with steer(model, bank, units=[2, 3], unit_type="head"):
        by_heads = model(ids).logits
    assert torch.equal(by_group, by_heads)


# -- a bank made of a prefix's own K/V, placed at its positions, reproduces running P + S


@pytest.mark.parametrize("family, rope", [(f, None) for f in FAMILY_IDS] + [("llama", YARN)],
                         ids=[*FAMILY_IDS, "llama-yarn-scaled-rope"])
def test_prefix_bank_at_its_positions_reproduces_the_full_sequence(family, rope):
    overrides = {"rope_parameters": rope} if rope else {}
    if family in ("mistral", "mixtral", "gemma2", "gemma3_text"):
        overrides["sliding_window"] = 64  # slots ignore the window: fit the whole pass in it
    model = tiny_model(family, **overrides)
    prefix, suffix = token_ids(1, 7, seed=3), token_ids(1, 5, seed=4)
    full = model(torch.cat([prefix, suffix], dim=1)).logits[:, prefix.shape[1]:]
    keys, values = capture_kv(model, prefix, range(LAYERS))
    bank = MemoryBank.from_tensors(keys[:, 0], values[:, 0], name="prefix", gain=0.0,
                                   positions=torch.arange(prefix.shape[1]))
    positions = torch.arange(prefix.shape[1], prefix.shape[1] + suffix.shape[1])[None]
    with steer(model, BankSet([bank], size_normalize=False)):
        steered = model(suffix, position_ids=positions).logits
    # gemma2's own (eager) attention takes its softmax in float32 even in a float64 model
    torch.testing.assert_close(steered, full, **(dict(rtol=1e-6, atol=1e-6)
                                                 if family == "gemma2" else TOL))
    assert not torch.allclose(model(suffix, position_ids=positions).logits, full, atol=1e-3)


@pytest.mark.parametrize("rope", [None, YARN], ids=["default-rope", "yarn-scaled-rope"])
def test_relative_phase_zero_equals_canonical(rope):
    model = tiny_model("llama", **({"rope_parameters": rope} if rope else {}))
    assert (model.model.rotary_emb.attention_scaling != 1.0) == (rope is not None)
    plain = random_bank("t", "target", 4)
    phased = random_bank("t", "target", 4, phases=torch.zeros(4))
    ids = token_ids()
    with steer(model, [plain]):
        canonical = model(ids).logits
    with steer(model, [phased]):
        zero = model(ids).logits
    torch.testing.assert_close(zero, canonical, **TOL)
    with steer(model, [random_bank("t", "target", 4, phases=torch.full((4,), 5.0))]):
        assert not torch.allclose(model(ids).logits, canonical, atol=1e-6)


# -- causality, padding, decoding


def test_no_causal_leak():
    model = tiny_model("qwen2")
    ids = token_ids(1, 10)
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 96 + 1
    with steer(model, [random_bank("t", "target", 5), random_bank("a", "auxiliary", 3)]):
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_left_padded_batch_equals_unbatched_runs(family):
    model = tiny_model(family)
    short, long = token_ids(1, 5, seed=5), token_ids(1, 9, seed=6)
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = (torch.arange(long.shape[1]) >= torch.tensor([[pad], [0]])).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    banks = [random_bank("t", "target", 5), random_bank("r", "reference", 4, seed=9)]
    with steer(model, banks):
        batched = model(batch, attention_mask=mask, position_ids=positions).logits
        alone = [model(short).logits, model(long).logits]
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched[0, pad:], alone[0][0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(batched[1], alone[1][0], rtol=1e-9, atol=1e-9)


def manual_greedy(model, ids, steps):
    cache = DynamicCache(config=model.config)
    logits = model(ids, **cache_kwargs(cache), use_cache=True).logits
    out = ids
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, token], dim=1)
        logits = model(token, **cache_kwargs(cache), use_cache=True).logits
    return out


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_greedy_generate_equals_a_manual_decode_loop(family):
    model = tiny_model(family)
    ids = token_ids(1, 6)
    banks = [random_bank("t", "target", 5, gain=2.0), random_bank("r", "reference", 3)]
    with steer(model, banks):
        generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected = manual_greedy(model, ids, 8)
    assert torch.equal(generated, expected)
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert not torch.equal(plain, generated), "the banks did not change greedy decoding"


def test_custom_generate_equals_the_context_manager():
    model = tiny_model("llama")
    ids = token_ids(2, 6)
    banks = [random_bank("t", "target", 5, gain=2.0)]
    with steer(model, banks, layers=[1, 2]):
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    generated = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                               custom_generate=steered_generate, banks=banks,
                               steering={"layers": [1, 2]})
    assert torch.equal(generated, expected)
    assert_restored(model)


def test_sampled_decoding_is_reproducible_and_finite():
    model = tiny_model("qwen3")
    ids = token_ids(2, 6)
    with steer(model, [random_bank("t", "target", 5)]):
        runs = []
        for _ in range(2):
            torch.manual_seed(7)
            runs.append(model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0,
                                       pad_token_id=0, output_scores=True,
                                       return_dict_in_generate=True))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert all(torch.isfinite(s).all() for s in runs[0].scores)


@torch.no_grad()
def test_update_swaps_banks_without_touching_the_cache():
    model = tiny_model("llama")
    ids = token_ids(1, 6)
    first, second = [random_bank("a", "target", 4, seed=1)], [random_bank("b", "target", 4, seed=2)]
    token = torch.tensor([[5]])
    handle = steer(model, first)
    cache = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(cache), use_cache=True)
    twin = copy.deepcopy(cache)
    length = cache.get_seq_length()
    handle.update(second)
    assert cache.get_seq_length() == length
    swapped = model(token, **cache_kwargs(cache), use_cache=True).logits
    handle.remove()
    with steer(model, second):
        fresh = model(token, **cache_kwargs(twin), use_cache=True).logits
    assert torch.equal(swapped, fresh)
    events = [(r["event"], r["banks"][0]["name"]) for r in handle.audit_log][:4]
    assert events == [("activate", "a"), ("forward from an empty cache", "a"), ("update", "b"),
                      ("remove", "b")]


def test_every_steered_generation_is_audited():
    model = tiny_model("llama")
    bank = random_bank("persona", "target", 4)
    with steer(model, [bank], layers=[2]) as handle:
        model.generate(token_ids(1, 5), max_new_tokens=3, do_sample=False, pad_token_id=0)
    forwards = [r for r in handle.audit_log if r["event"] == "forward from an empty cache"]
    assert len(forwards) == 1
    (record,) = forwards
    assert record["banks"] == [{"name": "persona", "role": "target", "gain": 1.0,
                                "content_hash": bank.content_hash()}]
    assert record["sites"] == {"2": [0, 1, 2, 3]}
    assert handle.audit_log[-1]["event"] == "remove"


def test_routing_mass_is_recorded_and_sums_to_one():
    model = tiny_model("llama")
    with steer(model, [random_bank("t", "target", 4), random_bank("r", "reference", 4)],
               layers=[1], units=[0, 2]) as handle:
        handle.record_routing()
        model(token_ids(2, 5))
        (routing,) = handle.routing()[1]
    assert routing.shape == (2, 2, 5, 3)
    torch.testing.assert_close(routing.sum(-1), torch.ones(2, 2, 5, dtype=routing.dtype))


def test_routing_per_slot_adds_up_to_each_banks_mass():
    model = tiny_model("llama")
    banks = [random_bank("t", "target", 4), random_bank("r", "reference", 3, seed=2),
             random_bank("a", "auxiliary", 2, seed=3)]
    recorded = {}
    for per_slot in (False, True):
        with steer(model, banks, layers=[1], units=[0, 2]) as handle:
            handle.record_routing(per_slot=per_slot)
            model(token_ids(2, 5))
            (recorded[per_slot],) = handle.routing()[1]
    per_bank, per_slot = recorded[False], recorded[True]
    assert per_slot.shape == (2, 2, 5, 1 + 4 + 3 + 2)
    grouped = torch.stack([per_slot[..., 0], per_slot[..., 1:5].sum(-1),
                           per_slot[..., 5:8].sum(-1), per_slot[..., 8:].sum(-1)], dim=-1)
    torch.testing.assert_close(grouped, per_bank)


def test_routing_per_slot_follows_the_slots_order():
    model = tiny_model("llama")
    bank = random_bank("t", "target", 5, positions=torch.tensor([-7, -6, -5, -4, -3]))
    order = torch.tensor([3, 0, 4, 1, 2])
    shuffled = MemoryBank.from_tensors(bank.keys[:, :, order], bank.values[:, :, order],
                                       name="t", layers=bank.layers,
                                       positions=bank.positions[order])
    recorded = []
    for one in (bank, shuffled):
        with steer(model, [one], layers=[1, 2]) as handle:
            handle.record_routing(per_slot=True)
            model(token_ids(2, 5))
            recorded.append(handle.routing())
    for layer in (1, 2):
        (plain,), (moved,) = recorded[0][layer], recorded[1][layer]
        torch.testing.assert_close(moved[..., 1:], plain[..., 1:][..., order])


def test_keep_slots_keeps_those_slots_at_every_layer_with_their_positions():
    bank = random_bank("t", "target", 5, positions=torch.tensor([-7, -6, -5, -4, -3]))
    kept = bank.keep_slots([3, 0, 4])
    assert torch.equal(kept.keys, bank.keys[:, :, [0, 3, 4]])
    assert torch.equal(kept.values, bank.values[:, :, [0, 3, 4]])
    assert kept.positions.tolist() == [-7, -4, -3] and kept.layers == bank.layers
    assert (kept.provenance["slots_kept"], kept.provenance["slots_of"]) == ([0, 3, 4], 5)
    again = kept.keep_slots([2])  # indices of the kept bank; the provenance counts the first's
    assert torch.equal(again.keys, bank.keys[:, :, [4]])
    assert (again.provenance["slots_kept"], again.provenance["slots_of"]) == ([4], 5)
    for bad in ([], [5], [-1], [1, 1], "01"):
        with pytest.raises(ValueError, match="slots must be distinct indices in"):
            bank.keep_slots(bad)


# -- bad input


def test_unsupported_architecture_is_named():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    supported = ("llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, granite, olmo2, gemma2, phi3, "
                 "gemma3_text")
    with pytest.raises(UnsupportedModelError, match=f"'gpt2'.*{supported}"):
        steer(model, [])


@pytest.mark.parametrize("field, bad, message", [
    ("keys", torch.full((3, KVH, 2, D), float("nan")), "NaN"),
    ("role", "villain", "role must be one of"),
    ("gain", -1.0, "gain must be finite and >= 0"),
    ("layers", (0, 0, 1), "distinct"),
])
def test_bad_banks_are_rejected(field, bad, message):
    good = dict(name="t", role="target", keys=torch.zeros(3, KVH, 2, D),
                values=torch.zeros(3, KVH, 2, D), layers=(0, 1, 2))
    with pytest.raises(ValueError, match=message):
        MemoryBank(**{**good, field: bad})


def test_banks_that_do_not_fit_the_model_are_rejected():
    model = tiny_model("llama")
    wrong_heads = MemoryBank.from_tensors(torch.zeros(1, 3, 2, D), torch.zeros(1, 3, 2, D),
                                          name="t", layers=(0,))
    with pytest.raises(ValueError, match="3 KV heads"):
        steer(model, [wrong_heads])
    with pytest.raises(ValueError, match="covers layer 7"):
        steer(model, [random_bank("t", "target", 2, layers=(7,))])
    with pytest.raises(ValueError, match="at most one target"):
        BankSet([random_bank("a", "target", 2), random_bank("b", "target", 2)])
    with pytest.raises(ValueError, match="units must be indices"):
        steer(model, [random_bank("t", "target", 2)], units=[4])
    assert_restored(model)


def test_unsupported_attention_implementation_is_named():
    model = tiny_model("llama", attn="eager")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="set_attn_implementation\\('sdpa'\\)"):
        steer(model, [])
