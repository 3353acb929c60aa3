"""The steering's fast path — the banks merged into the model's own SDPA kernel's output by its
log-sum-exp (``hf_memory.steering.stock_attention``, ``mixture.bank_mixture_by_lse``) — against the
reference path that recomputes the history beside the stock call (``mixture_path="reference"``)
and against a float64 softmax written out here. Tiny float64 models of every SDPA family:
whole-layer and head-subset sites, GQA, left padding, windows, per-row banks, positioned banks,
the contrastive gate, the dial, cached decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_memory import BankSet, MemoryBank, steer
from hf_memory.steering.stock_attention import _aligned, attention_with_lse
from tests.tiny_models import DEFAULT_ATTENTION, FAMILIES, tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

SDPA_FAMILIES = [f for f in FAMILIES if DEFAULT_ATTENTION.get(f, "sdpa") == "sdpa"]
TOL = dict(rtol=1e-10, atol=1e-10)
KVH, D = 2, 16


def bank(name, role, slots, *, seed, gain=1.0, positioned=False):
    gen = torch.Generator().manual_seed(seed)
    shape = (3, KVH, slots, D)
    positions = torch.arange(-slots, 0) if positioned else None
    return MemoryBank.from_tensors(torch.randn(shape, generator=gen, dtype=torch.float64) * 2,
                                   torch.randn(shape, generator=gen, dtype=torch.float64),
                                   name=name, role=role, layers=(0, 1, 2), gain=gain,
                                   positions=positions)


def contrastive(positioned=False):
    return BankSet([bank("t", "target", 5, seed=1, gain=1.5, positioned=positioned),
                    bank("r", "reference", 3, seed=2, gain=0.7),
                    bank("a", "auxiliary", 4, seed=3, gain=0.4)], gamma=1.3)


def padded_batch():
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :6] = 0
    return ids, mask


def both_paths(model, banks, call, **kwargs):
    out = {}
    for path in ("auto", "reference"):
        with steer(model, banks, mixture_path=path, **kwargs):
            out[path] = call()
    return out["auto"], out["reference"]


@pytest.mark.parametrize("family", SDPA_FAMILIES)
@pytest.mark.parametrize("sites", [None, {1: [0, 3], 2: [1, 2, 3]}], ids=["layers", "heads"])
def test_fast_path_equals_the_reference_path(family, sites, lse_calls):
    model = tiny_model(family)
    ids, mask = padded_batch()
    fast, reference = both_paths(model, contrastive(positioned=True),
                                 lambda: model(ids, attention_mask=mask).logits, units=sites,
                                 layer_gains={1: 0.8, 2: 1.2})
    assert lse_calls, "the fast path did not run"
    torch.testing.assert_close(fast, reference, **TOL)
    assert not torch.allclose(fast, model(ids, attention_mask=mask).logits, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("strength", [0.4, 1.0])
def test_cached_generation_equals_the_reference_path(family, strength, lse_calls):
    """Prefill and single-token decoding (GQA heads packed as rows) with left padding: greedy
    tokens equal, and the per-step scores at 1e-10."""
    model = tiny_model(family)
    ids, mask = padded_batch()

    def generate():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        return out.sequences, torch.stack(out.scores)

    (tokens, scores), (ref_tokens, ref_scores) = both_paths(
        model, contrastive(), generate, strength=strength, size_normalize=False)
    assert any(shape[2] == 1 for shape in lse_calls), "no decoding step took the fast path"
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, **TOL)


def test_per_row_banks_take_the_fast_path(lse_calls):
    model = tiny_model("llama")
    ids, mask = padded_batch()
    rows = [contrastive(), None, BankSet([bank("t2", "target", 6, seed=7)])]
    fast, reference = both_paths(model, rows, lambda: model(ids, attention_mask=mask).logits)
    assert lse_calls
    torch.testing.assert_close(fast, reference, **TOL)
    plain = model(ids, attention_mask=mask).logits
    assert torch.equal(fast[1], plain[1])  # the plain row is the stock model's, bit for bit


def test_the_torch_path_is_the_log_sum_exp_merge_in_pytorch_ops(lse_calls):
    """``mixture_path="torch"`` (never the Triton merge) runs the same log-sum-exp path as
    ``auto`` does on the CPU: the same logits, bit for bit."""
    model = tiny_model("llama")
    ids, mask = padded_batch()
    out = {}
    for path in ("auto", "torch"):
        with steer(model, contrastive(), mixture_path=path):
            out[path] = model(ids, attention_mask=mask).logits
    assert len(lse_calls) == 2 * len(contrastive().banks[0].layers)
    assert torch.equal(out["auto"], out["torch"])


def test_unknown_mixture_path_is_named():
    with pytest.raises(ValueError, match="mixture_path must be one of"):
        steer(tiny_model("llama"), contrastive(), mixture_path="fast")


def test_soft_capped_and_eager_models_keep_the_reference_path(lse_calls):
    model = tiny_model("gemma2")  # eager attention with a logit soft-cap
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with steer(model, contrastive()):
        model(ids)
    assert not lse_calls


# -- the kernel call against a float64 softmax written out here


def softmax_reference(query, key, value, visible, scaling, kv_index):
    k, v = key[:, kv_index].double(), value[:, kv_index].double()
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v, lse


@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       q_len=st.integers(1, 4), extra=st.integers(0, 5), mask=st.sampled_from(
           ["none", "shared", "per_head", "empty_row"]), subset=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attention_with_lse_equals_a_float64_softmax(batch, kv_heads, group, q_len, extra, mask,
                                                     subset, seed):
    """Output and log-sum-exp for every head layout (packed decoding, repeated KV, a gathered
    subset of heads) and mask kind; a row that sees nothing reads 0 with lse −inf."""
    span = q_len + (extra if mask != "none" or q_len == 1 else 0)
    heads = kv_heads * group
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, q_len, 8, generator=gen, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, span, 8, generator=gen, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, span, 8, generator=gen, dtype=torch.float64)
    kv_index = torch.arange(heads) // group
    chosen = None
    if subset and heads > 1:
        chosen = torch.tensor([heads - 1, 0])
        query, kv_index = query[:, chosen], kv_index[chosen]
    visible = None
    if mask != "none":
        per = query.shape[1] if mask == "per_head" else 1
        visible = torch.rand(batch, per, q_len, span, generator=gen) < 0.7
        visible[..., -1] = True
        if mask == "empty_row":
            visible[0, :, 0] = False
    out, lse = attention_with_lse(query, key, value, visible, scaling=0.7,
                                  kv_index=None if chosen is None else kv_index)
    want, want_lse = softmax_reference(
        query, key, value,
        visible if visible is not None or q_len == 1 else
        torch.ones(q_len, span, dtype=torch.bool).tril()[None, None], 0.7, kv_index)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_long_query_over_a_longer_history_needs_its_mask():
    q = torch.zeros(1, 2, 3, 4)
    kv = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="needs its visibility mask"):
        attention_with_lse(q, kv, kv, None, scaling=1.0)


@pytest.mark.parametrize("width", [5, 16, 37])
def test_a_mask_is_laid_out_in_rows_of_16_for_the_cuda_kernel(width):
    """The memory-efficient CUDA kernel reads its bias in rows aligned to 16 elements: a mask
    whose rows are not is copied into such rows (same values), one whose rows are is not."""
    mask = torch.randn(2, 3, 4, width)
    aligned = _aligned(mask)
    assert torch.equal(aligned, mask)
    assert all(stride % 16 == 0 for stride in aligned.stride()[:-1])
    assert (aligned.data_ptr() == mask.data_ptr()) == (width % 16 == 0)
    broadcast = _aligned(mask[:, :1].expand(2, 3, 4, width))
    assert torch.equal(broadcast, mask[:, :1].expand(2, 3, 4, width))

