"""Property-based tests (hypothesis) of three numerical cores against float64 references written
out here, independently of the code under test:

* the memory-inception bank mixture (``hf_memory.steering.mixture.bank_mixture``), which computes
  one softmax over [prompt keys ; bank slots] with per-column biases (appendix G.1), against the
  bank-level mixture o* = sum_b pi_b o_b it stands for, written per query head with a separate
  softmax per bank: prompt evidence logsumexp(q.k over the visible keys) - log T_t, bank evidence
  logsumexp(q.slot keys) - log M_b + c_b (c_b with the contrastive gate of eq. 8 when a target and a
  reference bank are both present), pi = softmax over the evidences. Random shapes with grouped-
  query attention, one-slot and several banks, pre/post-RoPE slots, five kinds of mask (none,
  causal, random shared or per head, additive float), scores up to +-1e3, fully masked query rows,
  float32 / float64 compute and float16 / bfloat16 inputs;
* stablemax (``log_stablemax``, ``stablemax_cross_entropy``) against s(x) / sum s written with
  Python floats, logits up to +-1e30, and its gradient (gradcheck and the closed form);
* the exact streaming top-k (``StreamingTopK``) against ``topk_reference`` and a plain Python
  sort: heavy ties, -0.0 and 0.0, +-inf, random chunkings (empty chunks, chunks larger than k),
  shuffled sparse positions up to 2**32 - 1, k larger than the stream; NaN is rejected.

Every example draws its own tensor seed (or its values directly), so a failure is reproduced by
the falsifying example hypothesis prints (``print_blob=True`` adds the ``@reproduce_failure``
line). Shapes are tiny and example counts small: the file runs in well under a minute on two
CPU cores.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hf_memory.analysis.streaming_topk import StreamingTopK, topk_reference
from hf_memory.steering.mixture import (
    BankStack,
    HeadSlots,
    PreparedBank,
    bank_mixture,
    bank_mixture_by_lse,
    bank_mixture_over,
    history_bias,
    toward,
    visible_keys,
)
from modeling.air.modeling_air import _stablemax_s, log_stablemax, stablemax_cross_entropy

PROPERTY = settings(max_examples=100, deadline=None, derandomize=False, print_blob=True)
F32_EPS = 2.0**-24  # unit roundoff (round to nearest) of float32
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# the largest absolute rounding error below the smallest normal (half the smallest subnormal)
SUBNORMAL_ERROR = {torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}


# ============================================================================ bank mixture
MASKS = ("none", "causal", "shared", "per_head", "additive")


@st.composite
def mixture_cases(draw, *, peaks=(None, 1.0, 30.0, 1e3), masked_rows: bool = False) -> dict:
    """Shapes (heads a multiple of the KV heads), 1-4 banks (at most one target and one
    reference, as ``BankSet`` allows, and auxiliaries; one-slot banks often), gains,
    rho, gamma, size normalisation, a mask kind and the peak |score| the queries are rescaled to
    (None: unscaled unit-normal queries). ``masked_rows``: a random mask with at least one fully
    masked query row."""
    kv_heads = draw(st.integers(1, 2))
    roles = (["target"] * draw(st.booleans()) + ["reference"] * draw(st.booleans())
             + ["auxiliary"] * draw(st.integers(0, 2)))
    if not roles:
        roles = [draw(st.sampled_from(["target", "reference", "auxiliary"]))]
    roles = draw(st.permutations(roles))
    n = len(roles)
    return dict(
        batch=draw(st.integers(1, 2)), kv_heads=kv_heads, heads=kv_heads * draw(st.integers(1, 3)),
        q_len=draw(st.integers(1, 3)), span=draw(st.integers(1, 5)), dim=draw(st.integers(1, 4)),
        roles=roles,
        slots=draw(st.lists(st.one_of(st.just(1), st.integers(1, 4)), min_size=n, max_size=n)),
        post=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        gains=draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n)),
        rho=draw(st.floats(0.0, 3.0)), gamma=draw(st.floats(0.0, 4.0)),
        size_normalize=draw(st.booleans()),
        mask=draw(st.sampled_from(("shared", "per_head") if masked_rows else MASKS)),
        masked_rows=masked_rows,
        peak=draw(st.sampled_from(peaks)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build_mixture(case: dict) -> dict:
    """float64 inputs of ``case``: queries, prompt keys/values, bank slots, the boolean
    visibility (None: all visible) and the mask handed to ``visible_keys``."""
    b, h, t, s, d = (case[n] for n in ("batch", "heads", "q_len", "span", "dim"))
    kvh = case["kv_heads"]
    gen = torch.Generator().manual_seed(case["seed"])

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs = dict(q_pre=randn(b, h, t, d), q_post=randn(b, h, t, d), key=randn(b, kvh, s, d),
                  value=randn(b, kvh, s, d),
                  bank_keys=[randn(kvh, m, d) for m in case["slots"]],
                  bank_values=[randn(kvh, m, d) for m in case["slots"]])
    scaling = d**-0.5
    if case["peak"] is not None:  # rescale the queries: the largest |score| becomes the peak
        group = h // kvh
        keys = [inputs["key"].repeat_interleave(group, 1)]
        keys += [k.repeat_interleave(group, 0)[None].expand(b, -1, -1, -1)
                 for k in inputs["bank_keys"]]
        top = max((q @ k.transpose(-1, -2)).abs().max().item() * scaling
                  for q in (inputs["q_pre"], inputs["q_post"]) for k in keys)
        inputs["q_pre"] = inputs["q_pre"] * (case["peak"] / top)
        inputs["q_post"] = inputs["q_post"] * (case["peak"] / top)

    kind, mask = case["mask"], None
    if kind == "causal":
        mask = None  # what the model passes for a causal mask without padding (SDPA's skip)
    elif kind != "none":
        rows = b if torch.rand((), generator=gen) < 0.5 else 1
        cols = h if kind == "per_head" else 1
        mask = torch.rand(rows, cols, t, s, generator=gen) < 0.6
        empty = torch.rand(rows, cols, t, 1, generator=gen) < 0.25
        if case["masked_rows"]:
            empty.view(-1)[torch.randint(empty.numel(), (), generator=gen)] = True
        mask = mask & ~empty
        if kind == "additive":  # a float mask: 0 keeps, the dtype's minimum drops
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    if kind == "none":
        visible = None
    else:
        visible = visible_keys(mask, t, s, torch.device("cpu"))
    inputs.update(visible=visible, mask=mask, scaling=scaling)
    return inputs


def reference_mixture(inputs: dict, case: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The bank-level mixture in float64, one query head and position at a time:
    ``(output [B, H, T, D], routing [B, H, T, 1 + n_banks], largest |score|)``."""
    q_pre, q_post = inputs["q_pre"].double(), inputs["q_post"].double()
    key, value = inputs["key"].double(), inputs["value"].double()
    visible, scaling = inputs["visible"], inputs["scaling"]
    banks = list(zip(case["roles"], [k.double() for k in inputs["bank_keys"]],
                     [v.double() for v in inputs["bank_values"]], case["gains"], case["post"],
                     strict=True))
    rho, gamma, normalize = case["rho"], case["gamma"], case["size_normalize"]
    contrastive = "target" in case["roles"] and "reference" in case["roles"]
    b_, h_, t_, d_ = q_post.shape
    group = h_ // key.shape[1]
    out = torch.zeros(b_, h_, t_, d_, dtype=torch.float64)
    routing = torch.zeros(b_, h_, t_, 1 + len(banks), dtype=torch.float64)
    peak = 0.0
    for b in range(b_):
        for h in range(h_):
            kv = h // group
            for t in range(t_):
                seen = (torch.ones(key.shape[2], dtype=torch.bool) if visible is None else
                        visible[min(b, visible.shape[0] - 1), min(h, visible.shape[1] - 1), t])
                evidence, outputs, log_mean, scores = [], [], {}, []
                s = key[b, kv][seen] @ q_post[b, h, t] * scaling
                if len(s):
                    peak = max(peak, s.abs().max().item())
                    evidence.append(torch.logsumexp(s, 0)
                                    - (math.log(len(s)) if normalize else 0.0))
                    outputs.append(torch.softmax(s, 0) @ value[b, kv][seen])
                else:  # no visible key: the prompt bank has no evidence
                    evidence.append(torch.tensor(-math.inf, dtype=torch.float64))
                    outputs.append(torch.zeros(d_, dtype=torch.float64))
                for role, keys, _, _, post in banks:
                    sb = keys[kv] @ (q_post if post else q_pre)[b, h, t] * scaling
                    peak = max(peak, sb.abs().max().item())
                    scores.append(sb)
                    log_mean[role] = torch.logsumexp(sb, 0) - math.log(len(sb))
                for (role, _, values, gain, _), sb in zip(banks, scores, strict=True):
                    if role == "auxiliary":
                        c = rho * gain
                    elif not contrastive:  # a lone target or reference bank: gate 1
                        c = rho * gain * (1.0 if role == "target" else -1.0)
                    else:
                        gap = log_mean["target"] - log_mean["reference"]
                        c = (rho * gain * torch.sigmoid(gamma * gap) if role == "target"
                             else -rho * gain * torch.sigmoid(-gamma * gap))
                    evidence.append(torch.logsumexp(sb, 0)
                                    - (math.log(len(sb)) if normalize else 0.0) + c)
                    outputs.append(torch.softmax(sb, 0) @ values[kv])
                pi = torch.softmax(torch.stack(evidence), 0)
                out[b, h, t] = sum(p * o for p, o in zip(pi, outputs, strict=True))
                routing[b, h, t] = pi
    return out, routing, peak


def rounded(inputs: dict, dtype: torch.dtype) -> dict:
    """``inputs`` with every query, key and value rounded to ``dtype``."""
    return {**inputs, **{n: inputs[n].to(dtype) for n in ("q_pre", "q_post", "key", "value")},
            "bank_keys": [k.to(dtype) for k in inputs["bank_keys"]],
            "bank_values": [v.to(dtype) for v in inputs["bank_values"]]}


def run_mixture(inputs: dict, case: dict, dtype: torch.dtype, compute: torch.dtype,
                with_routing: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``bank_mixture`` with queries, keys and values in ``dtype`` and the bank stack in
    ``compute`` (as steering builds it: bank slots promoted to at least float32)."""
    banks = [PreparedBank(role, k.to(dtype).to(compute), v.to(dtype).to(compute), gain, post)
             for role, k, v, gain, post in zip(case["roles"], inputs["bank_keys"],
                                               inputs["bank_values"], case["gains"],
                                               case["post"], strict=True)]
    stack = BankStack.of(banks, rho=case["rho"], size_normalize=case["size_normalize"])
    return bank_mixture(inputs["q_pre"].to(dtype), inputs["q_post"].to(dtype),
                        inputs["key"].to(dtype), inputs["value"].to(dtype), inputs["visible"],
                        stack, scaling=inputs["scaling"], gamma=case["gamma"],
                        size_normalize=case["size_normalize"],
                        with_routing=with_routing)


def compute_tolerance(compute: torch.dtype, peak: float) -> float:
    """atol = rtol for outputs and routing computed in ``compute``: c * max(1, peak |score|),
    c = 1e-12 in float64 and 1e-5 (the suite's float32 tolerance) in float32. A score s is
    rounded by ~|s| * eps per operation, and softmax turns column errors of at most e into
    output errors of at most (exp(2e) - 1) * max|v| (the weights change by a factor within
    exp(+-2e)), so the error bound grows with the score magnitude: ~1e-4 absolute at |s| = 1e3
    in float32 when two columns nearly tie there."""
    return (1e-12 if compute == torch.float64 else 1e-5) * max(1.0, peak)


def check_routing(routing: torch.Tensor, tol: float) -> None:
    """Routing masses are in [0, 1] and sum to 1 over the banks (up to ``tol``: the prompt mass
    is a rounded sum of softmax weights, which may exceed 1 by a few ulp)."""
    assert torch.isfinite(routing).all()
    assert (routing >= 0).all()
    assert (routing <= 1 + tol).all()
    torch.testing.assert_close(routing.sum(-1), torch.ones(routing.shape[:-1],
                                                           dtype=routing.dtype),
                               rtol=0, atol=tol)


# The contrastive gate at scores of 1e3 with GQA, one-slot banks and a mask with an empty row.
EXTREME = dict(batch=1, kv_heads=2, heads=4, q_len=2, span=3, dim=2,
               roles=["target", "auxiliary", "reference"], slots=[1, 3, 1],
               post=[False, True, False], gains=[1.5, 0.5, 2.0], rho=2.0, gamma=4.0,
               size_normalize=True, mask="per_head", masked_rows=True, peak=1e3, seed=0)


@PROPERTY
@given(case=mixture_cases(), compute=st.sampled_from([torch.float32, torch.float64]))
@example(case=EXTREME, compute=torch.float64)
@example(case=EXTREME, compute=torch.float32)
def test_bank_mixture_equals_the_bank_level_mixture(case, compute):
    """(a, d) For random shapes with GQA, 1-4 banks (one-slot banks, pre/post-RoPE slots, the
    contrastive gate), every mask kind and scores up to +-1e3, the output and the routing
    masses are finite and equal the float64 bank-level mixture (``compute_tolerance``); the
    routing masses are in [0, 1] and sum to 1; asking for routing leaves the output unchanged;
    ``visible_keys`` reads a float mask as ``mask == 0`` and None as causal."""
    inputs = build_mixture(case)
    if case["mask"] == "additive":
        assert torch.equal(inputs["visible"], inputs["mask"] == 0)
    if case["mask"] == "causal" and case["q_len"] > 1:  # aligned to the last key
        t, s = case["q_len"], case["span"]
        want = torch.tensor([[j <= i + s - t for j in range(s)] for i in range(t)])
        assert torch.equal(inputs["visible"], want[None, None])
    dtype = compute  # float32 or float64 inputs, no input rounding beyond the compute dtype's
    expected, routing_ref, peak = reference_mixture(rounded(inputs, dtype), case)
    out, routing = run_mixture(inputs, case, dtype, compute)
    assert out.dtype == compute and out.shape == expected.shape
    assert torch.isfinite(out).all()
    tol = compute_tolerance(compute, peak)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(routing.double(), routing_ref, rtol=tol, atol=tol)
    check_routing(routing, 1e-12 if compute == torch.float64 else 1e-5)
    plain, none = run_mixture(inputs, case, dtype, compute, with_routing=False)
    assert none is None
    assert torch.equal(plain, out)


@PROPERTY
@given(case=mixture_cases(masked_rows=True), compute=st.sampled_from([torch.float32,
                                                                      torch.float64]))
@example(case=EXTREME, compute=torch.float32)
def test_fully_masked_query_rows_read_the_banks_only(case, compute):
    """(b) A query row with no visible prompt key gets prompt routing mass exactly 0 and the
    banks' mixture alone (the float64 reference without the prompt bank), finite; the gradients
    of every input are finite too (no NaN from the all -inf prompt row)."""
    inputs = build_mixture(case)
    dtype = compute
    leaves = {n: inputs[n].to(dtype).requires_grad_() for n in ("q_pre", "q_post", "key",
                                                                  "value")}
    expected, routing_ref, peak = reference_mixture(rounded(inputs, dtype), case)
    out, routing = run_mixture({**inputs, **leaves}, case, dtype, compute)
    empty = ~inputs["visible"].any(-1).expand(case["batch"], case["heads"], -1)  # [B, H, T]
    assert empty.any()
    assert torch.isfinite(out).all()
    assert (routing[..., 0][empty] == 0).all()
    assert (routing_ref[..., 0][empty] == 0).all()
    tol = compute_tolerance(compute, peak)
    torch.testing.assert_close(out.double()[empty], expected[empty], rtol=tol, atol=tol)
    torch.testing.assert_close(routing.double()[empty], routing_ref[empty], rtol=tol, atol=tol)
    check_routing(routing, 1e-12 if compute == torch.float64 else 1e-5)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), list(leaves.values()), allow_unused=True)
    for g in grads:  # None: q_pre unused (every slot scored with the post-RoPE query)
        assert g is None or torch.isfinite(g).all()


def history_attention(inputs: dict, softcap: float | None = None) -> torch.Tensor:
    """Plain attention of the post-RoPE queries over the visible prompt keys, float64, per query
    head with its KV head repeated (what the stock attention hands the vLLM worker); a row with no
    visible key reads zeros."""
    q, key, value = inputs["q_post"].double(), inputs["key"].double(), inputs["value"].double()
    group = q.shape[1] // key.shape[1]
    scores = q @ key.repeat_interleave(group, 1).transpose(-1, -2) * inputs["scaling"]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if inputs["visible"] is not None:
        scores = scores.masked_fill(~inputs["visible"], float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ value.repeat_interleave(group, 1)


def stack_of(inputs: dict, case: dict, compute: torch.dtype) -> BankStack:
    banks = [PreparedBank(role, k.to(compute), v.to(compute), gain, post)
             for role, k, v, gain, post in zip(case["roles"], inputs["bank_keys"],
                                               inputs["bank_values"], case["gains"],
                                               case["post"], strict=True)]
    return BankStack.of(banks, rho=case["rho"], size_normalize=case["size_normalize"])


def by_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, T, D]`` → ``[KVH, B, G·T, D]``, the layout ``bank_mixture_over`` takes."""
    b, heads, t, d = x.shape
    return x.reshape(b, kv_heads, heads // kv_heads * t, d).transpose(0, 1)


def by_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[KVH, B, G·T, D]`` → ``[B, H, T, D]`` (the inverse of ``by_kv_head``)."""
    kv_heads, b, rows, d = x.shape
    return x.transpose(0, 1).reshape(b, heads, rows * kv_heads // heads, d)


def mixture_over_heads(history, q_pre, q_post, key, bias, stack, **kwargs):
    """``bank_mixture_over`` on operands laid out by head (``key`` ``[B, KVH, S, D]``)."""
    kv_heads, heads = key.shape[1], q_post.shape[1]
    got = bank_mixture_over(*(by_kv_head(x, kv_heads) for x in (history, q_pre, q_post)),
                            key.transpose(0, 1), bias, stack, **kwargs)
    return by_head(got, heads)


def mixture_over(history, q_pre, q_post, key, visible, stack, *, size_normalize, **kwargs):
    """``bank_mixture_over`` by head, with its bias made from ``visible`` by ``history_bias``."""
    b, heads, _, _ = q_post.shape
    bias = history_bias(visible, batch=b, span=key.shape[2], kv_heads=key.shape[1],
                        heads=heads, size_normalize=size_normalize, dtype=stack.keys.dtype)
    return mixture_over_heads(history, q_pre, q_post, key, bias.to(key.device), stack, **kwargs)


@PROPERTY
@given(case=mixture_cases(), compute=st.sampled_from([torch.float32, torch.float64]))
@example(case=EXTREME, compute=torch.float64)
@example(case=EXTREME, compute=torch.float32)
def test_mixture_over_the_stock_history_output_equals_the_bank_level_mixture(case, compute):
    """``bank_mixture_over`` — the prompt bank entered as one column whose value is the stock
    attention's output over the history and whose evidence is the history scores' log-sum-exp —
    equals the float64 bank-level mixture on every case of the test above (fully masked rows
    included: they read the banks only)."""
    inputs = build_mixture(case)
    expected, _, peak = reference_mixture(rounded(inputs, compute), case)
    history = history_attention(rounded(inputs, compute)).to(compute)
    out = mixture_over(history, inputs["q_pre"].to(compute), inputs["q_post"].to(compute),
                       inputs["key"].to(compute), inputs["visible"],
                       stack_of(inputs, case, compute), scaling=inputs["scaling"],
                       gamma=case["gamma"], size_normalize=case["size_normalize"])
    assert out.dtype == compute and out.shape == expected.shape
    assert torch.isfinite(out).all()
    tol = compute_tolerance(compute, peak)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def lse_operands(inputs: dict, case: dict, compute: torch.dtype):
    """``bank_mixture_by_lse``'s operands for a mixture case in ``compute``: ``(history, lse,
    q_pre, q_post, slots)`` — the history's attention output and the float64 log-sum-exp of its
    scores, per query head (KV heads by index) — and log T_t per row."""
    history = history_attention(rounded(inputs, compute)).to(compute)
    q, key = inputs["q_post"].to(compute).double(), inputs["key"].to(compute).double()
    group = case["heads"] // case["kv_heads"]
    scores = q @ key.repeat_interleave(group, 1).transpose(-1, -2) * inputs["scaling"]
    visible = inputs["visible"]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
        log_count = visible.sum(-1).clamp(min=1).double().log().to(compute)
    else:
        log_count = torch.tensor(float(key.shape[2])).log().to(compute)
    slots = HeadSlots.of(stack_of(inputs, case, compute), torch.arange(case["heads"]) // group)
    return (history, torch.logsumexp(scores, -1).to(compute), inputs["q_pre"].to(compute),
            inputs["q_post"].to(compute), slots), log_count


@PROPERTY
@given(case=mixture_cases(masked_rows=True), compute=st.sampled_from([torch.float32,
                                                                      torch.float64]),
       strength=st.sampled_from([1.0, 0.35]))
@example(case=EXTREME, compute=torch.float64, strength=1.0)
@example(case=EXTREME, compute=torch.float32, strength=0.35)
def test_mixture_by_the_history_lse_equals_the_bank_level_mixture(case, compute, strength):
    """``bank_mixture_by_lse`` — the history entered as its attention output and the log-sum-exp
    of its scores, per query head (KV heads by index) — equals the float64 bank-level mixture,
    moved ``strength`` of the way from the history, on every case above (fully masked rows read
    the banks only)."""
    inputs = build_mixture(case)
    expected, _, peak = reference_mixture(rounded(inputs, compute), case)
    operands, log_count = lse_operands(inputs, case, compute)
    out = bank_mixture_by_lse(
        *operands, scaling=inputs["scaling"], log_count=log_count, gamma=case["gamma"],
        size_normalize=case["size_normalize"], strength=strength).transpose(1, 2)
    assert out.dtype == compute and torch.isfinite(out).all()
    want = toward(operands[0].double(), expected, strength)
    tol = compute_tolerance(compute, peak)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("softcap", [None, 0.5, 5.0])
def test_mixture_over_the_history_equals_bank_mixture_with_a_soft_cap(softcap):
    """With Gemma 2's logit soft-cap (binding at 0.5), ``bank_mixture_over`` on the capped
    history's output equals ``bank_mixture`` in float64."""
    case = dict(EXTREME, peak=3.0, masked_rows=False, mask="causal", q_len=3, span=5)
    inputs = build_mixture(case)
    stack = stack_of(inputs, case, torch.float64)
    args = dict(scaling=inputs["scaling"], gamma=case["gamma"],
                size_normalize=case["size_normalize"], softcap=softcap)
    want, _ = bank_mixture(inputs["q_pre"], inputs["q_post"], inputs["key"], inputs["value"],
                           inputs["visible"], stack, **args)
    got = mixture_over(history_attention(inputs, softcap), inputs["q_pre"], inputs["q_post"],
                       inputs["key"], inputs["visible"], stack, **args)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("size_normalize", [True, False])
def test_mixture_over_whole_blocks_with_the_bias_equals_the_rows_own_keys(size_normalize):
    """The vLLM worker's layout: every row's keys padded to whole cache blocks with positions
    past its end (garbage, never seen), a visibility mask made for all rows at once and broadcast
    over heads (``[B, 1, T, S]``) and :func:`history_bias` made once from it — the same mixture,
    row by row, as ``bank_mixture_over`` on each row's own keys alone (float64, 1e-12)."""
    torch.manual_seed(3)
    kv_heads, heads, d, m, block = 2, 6, 8, 5, 4
    lengths = [3, 9, 6]  # one decoding query per row, seeing all its own keys
    span = block * max(-(-n // block) for n in lengths)
    keys = torch.randn(kv_heads, len(lengths), span, d, dtype=torch.float64) * 3
    q_pre, q_post, history = (torch.randn(len(lengths), heads, 1, d, dtype=torch.float64)
                              for _ in range(3))
    stack = BankStack.of([PreparedBank("target", torch.randn(kv_heads, m, d).double(),
                                       torch.randn(kv_heads, m, d).double(), 1.0, False)],
                         rho=0.5, size_normalize=size_normalize)
    visible = (torch.arange(span)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]
    bias = history_bias(visible, batch=len(lengths), span=span, kv_heads=kv_heads, heads=heads,
                        size_normalize=size_normalize, dtype=torch.float64)
    got = mixture_over_heads(history, q_pre, q_post, keys.transpose(0, 1), bias, stack,
                             scaling=0.4, strength=0.6)
    for row, n in enumerate(lengths):
        alone = mixture_over(history[row:row + 1], q_pre[row:row + 1], q_post[row:row + 1],
                             keys[:, row:row + 1, :n].transpose(0, 1), None, stack, scaling=0.4,
                             size_normalize=size_normalize, strength=0.6)
        torch.testing.assert_close(got[row:row + 1], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strength", [0.0, 0.3, 1.0, 1.7])
def test_mixture_over_the_history_folds_the_strength_dial(strength):
    """``bank_mixture_over(..., strength=s)`` = ``toward(history, mixture, s)``: the dial folded
    into the mixture's last product (0: the history's output exactly)."""
    case = dict(EXTREME, peak=3.0, masked_rows=False)
    inputs = build_mixture(case)
    stack = stack_of(inputs, case, torch.float64)
    history = history_attention(inputs)
    args = (inputs["q_pre"], inputs["q_post"], inputs["key"], inputs["visible"], stack)
    kwargs = dict(scaling=inputs["scaling"], gamma=case["gamma"],
                  size_normalize=case["size_normalize"])
    want = toward(history, mixture_over(history, *args, **kwargs), strength)
    got = mixture_over(history, *args, **kwargs, strength=strength)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def rounding_error(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |round_dtype(x) - x|: u |x|, or half the smallest subnormal below
    the normal range (``x`` in float64)."""
    return torch.maximum(x.abs() * UNIT_ROUNDOFF[dtype],
                         torch.full_like(x, SUBNORMAL_ERROR[dtype]))


def rounding_bound(inputs: dict, case: dict, dtype: torch.dtype) -> float:
    """Bound on |o(rounded inputs) - o(exact inputs)| (exact arithmetic). Each score q.k moves
    by at most e = scaling * max sum_d (|q_d| r(k_d) + r(q_d) |k_d| + r(q_d) r(k_d)) (r the
    rounding error bound); the log-mean-exp gap of eq. 8 by at most 2e, so the gate bias
    (sigmoid slope <= 1/4) by at most rho gain gamma e / 2; every softmax column therefore by at
    most e' = e (1 + rho max(gain) gamma / 2), the mixture weights by a factor within
    exp(+-2e'), and the output by at most (exp(2e') - 1) max|v~| + max r(v)."""
    group = case["heads"] // case["kv_heads"]
    keys = [inputs["key"].repeat_interleave(group, 1)]
    keys += [k.repeat_interleave(group, 0)[None] for k in inputs["bank_keys"]]
    e = 0.0
    for q in (inputs["q_pre"], inputs["q_post"]):
        rq = rounding_error(q, dtype)
        for k in keys:
            rk = rounding_error(k, dtype)
            moved = (q.abs() @ rk.transpose(-1, -2) + rq @ k.abs().transpose(-1, -2)
                     + rq @ rk.transpose(-1, -2))
            e = max(e, moved.max().item() * inputs["scaling"])
    e *= 1 + case["rho"] * max(case["gains"]) * case["gamma"] / 2
    values = [inputs["value"], *inputs["bank_values"]]
    v_max = max(v.to(dtype).double().abs().max().item() for v in values)
    r_max = max(rounding_error(v, dtype).max().item() for v in values)
    return math.expm1(2 * e) * v_max + r_max


@PROPERTY
@given(case=mixture_cases(peaks=(None, 1.0, 10.0, 100.0)),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_half_precision_inputs(case, dtype):
    """(c) float16 / bfloat16 queries, keys, values and bank slots (the stack promoted to
    float32, as steering builds it): the float32 output equals the float64 mixture of the
    rounded inputs within the float32 tolerance (``compute_tolerance``), and the float64
    mixture of the exact inputs within the bound the input rounding allows (``rounding_bound``:
    u = 2^-11 for float16, 2^-8 for bfloat16) plus that float32 tolerance."""
    inputs = build_mixture(case)
    out, routing = run_mixture(inputs, case, dtype, torch.float32)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    expected, routing_ref, peak = reference_mixture(rounded(inputs, dtype), case)
    tol = compute_tolerance(torch.float32, peak)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(routing.double(), routing_ref, rtol=tol, atol=tol)
    check_routing(routing, 1e-5)
    exact, _, _ = reference_mixture(inputs, case)
    bound = rounding_bound(inputs, case, dtype) + tol * (1 + exact.abs().max().item())
    assert (out.double() - exact).abs().max().item() <= bound


# ================================================================================ stablemax
def stablemax_reference(row: list[float]) -> list[float]:
    """log s(x_i) - log sum_j s(x_j), s(x) = x + 1 (x >= 0) or 1 / (1 - x), in Python floats."""
    s = [x + 1.0 if x >= 0 else 1.0 / (1.0 - x) for x in row]
    total = math.fsum(s)
    return [math.log(v) - math.log(total) for v in s]


HUGE = [0.0, -0.0, 1.0, -1.0, 1e-7, -1e-7, 1e30, -1e30, 1e6, -1e6]


def logit_rows(dtype: torch.dtype, bound: float):
    """Rows of 1-6 logits: finite floats within +-bound, exactly representable in ``dtype``,
    with the edge values of ``HUGE`` (within bound) mixed in."""
    width = 32 if dtype == torch.float32 else 64
    bound = torch.tensor(bound, dtype=dtype).item()  # the nearest value of the dtype
    element = st.one_of(st.floats(-bound, bound, width=width),
                        st.sampled_from([x for x in HUGE if abs(x) <= bound]))
    return st.lists(st.lists(element, min_size=1, max_size=6), min_size=1, max_size=3).map(
        lambda rows: [row + [0.0] * (max(map(len, rows)) - len(row)) for row in rows])


stablemax_inputs = st.one_of(
    st.tuples(st.just(torch.float64), logit_rows(torch.float64, 1e30)),
    st.tuples(st.just(torch.float32), logit_rows(torch.float32, 1e6)),
)


def stablemax_tolerance(dtype: torch.dtype, n: int) -> dict:
    """log p in float64: rtol = atol = 1e-13 (|log p| reaches ~140 at +-1e30, ~70 ulp of error
    budget). In float32: s, the n-term sum, the division and the log each round, so
    atol = 2 (n + 3) 2^-24 and rtol = 2^-22."""
    if dtype == torch.float64:
        return dict(rtol=1e-13, atol=1e-13)
    return dict(rtol=4 * F32_EPS, atol=2 * (n + 3) * F32_EPS)


@PROPERTY
@given(data=stablemax_inputs, bump=st.floats(1e-3, 1e3), at=st.integers(0, 5))
@example(data=(torch.float64, [[1e30, -1e30, 0.0, -0.0, 1e-7]]), bump=1.0, at=1)
@example(data=(torch.float32, [[1e6, -1e6, 1.0]]), bump=1e3, at=0)
def test_log_stablemax_is_a_normalised_monotone_distribution(data, bump, at):
    """log_stablemax of logits up to +-1e30 (float64) / +-1e6 (float32) is finite, <= 0,
    exponentiates to rows summing to 1 (logsumexp 0 within ``stablemax_tolerance``), equals
    log s(x) / sum s in Python floats, keeps the order of the logits within a row exactly (s,
    the division by the common sum and log are monotone), and raising one logit does not lower
    its probability nor raise the others' (up to the rounding of ``stablemax_tolerance``: the
    rounded sum may move by an ulp)."""
    dtype, rows = data
    x = torch.tensor(rows, dtype=dtype)
    n = x.shape[-1]
    tol = stablemax_tolerance(dtype, n)
    logp = log_stablemax(x)
    assert logp.dtype == dtype and torch.isfinite(logp).all() and (logp <= 0).all()
    torch.testing.assert_close(torch.logsumexp(logp.double(), -1),
                               torch.zeros(x.shape[0], dtype=torch.float64), rtol=0,
                               atol=tol["atol"])
    expected = torch.tensor([stablemax_reference(r) for r in x.double().tolist()],
                            dtype=torch.float64)
    torch.testing.assert_close(logp.double(), expected, **tol)
    order = x[..., :, None] >= x[..., None, :]  # x_i >= x_j  =>  log p_i >= log p_j
    assert (logp[..., :, None] >= logp[..., None, :])[order].all()
    assert torch.equal(torch.exp(logp) > 0, torch.ones_like(logp, dtype=torch.bool))

    at = at % n
    raised = x.clone()
    raised[:, at] = raised[:, at] + bump
    after = log_stablemax(raised)
    slack = tol["atol"] + tol["rtol"] * torch.maximum(logp.abs(), after.abs())
    others = torch.arange(n) != at
    assert (after[:, at] >= logp[:, at] - slack[:, at]).all()
    assert (after[:, others] <= logp[:, others] + slack[:, others]).all()


@PROPERTY
@given(data=st.one_of(st.tuples(st.just(torch.float64), logit_rows(torch.float64, 1e30)),
                      st.tuples(st.just(torch.float32), logit_rows(torch.float32, 1e30))),
       seed=st.integers(0, 2**31 - 1))
def test_stablemax_cross_entropy(data, seed):
    """stablemax_cross_entropy (float64 whatever the input) is exactly 0 at ignored labels
    (-100) and exactly -log_stablemax(float64 logits) at the label elsewhere (which
    ``test_log_stablemax_is_a_normalised_monotone_distribution`` checks against Python floats),
    and stays finite for logits up to +-1e30 in float32 too."""
    dtype, rows = data
    x = torch.tensor(rows, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(x.shape[-1], x.shape[:-1], generator=gen)
    labels[torch.rand(labels.shape, generator=gen) < 0.3] = -100
    loss = stablemax_cross_entropy(x, labels)
    assert loss.dtype == torch.float64 and loss.shape == labels.shape
    assert torch.isfinite(loss).all()
    ignored = labels == -100
    assert (loss[ignored] == 0).all()
    logp = log_stablemax(x.double())
    picked = -logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    assert torch.equal(loss[~ignored], picked[~ignored])
    expected = torch.tensor([-stablemax_reference(r)[y] if y != -100 else 0.0
                             for r, y in zip(x.double().tolist(), labels.tolist(),
                                             strict=True)], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, **stablemax_tolerance(torch.float64, 0))


@settings(max_examples=40, deadline=None, derandomize=False, print_blob=True)
@given(rows=st.lists(st.lists(st.one_of(st.floats(-5.0, 5.0), st.sampled_from(
    [0.0, 1e-7, -1e-7, 1.0])), min_size=2, max_size=4), min_size=1, max_size=2),
    seed=st.integers(0, 2**31 - 1))
def test_stablemax_gradcheck(rows, seed):
    """torch.autograd.gradcheck (float64, default eps 1e-6, atol 1e-5, rtol 1e-3) of
    log_stablemax and stablemax_cross_entropy on small logits, zeros included: s is C^1 at the
    branch point (s(0) = 1 and s'(0) = 1 on both sides; only s'' jumps, from 2 to 0), so the
    central difference across 0 is off by O(eps) = 5e-7 only and no input needs excluding."""
    width = min(map(len, rows))
    x = torch.tensor([r[:width] for r in rows], dtype=torch.float64, requires_grad=True)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(width, x.shape[:-1], generator=gen)
    labels[torch.rand(labels.shape, generator=gen) < 0.3] = -100
    assert torch.autograd.gradcheck(log_stablemax, (x,))
    assert torch.autograd.gradcheck(lambda z: stablemax_cross_entropy(z, labels), (x,))
    assert torch.autograd.gradcheck(_stablemax_s, (x,))


@PROPERTY
@given(data=st.one_of(st.tuples(st.just(torch.float64), logit_rows(torch.float64, 1e30)),
                      st.tuples(st.just(torch.float32), logit_rows(torch.float32, 1e30))),
       seed=st.integers(0, 2**31 - 1))
@example(data=(torch.float32, [[1e30, -1e30, 0.0, 2e4]]), seed=0)
def test_stablemax_cross_entropy_gradient_for_huge_logits(data, seed):
    """For logits up to +-1e30 the gradient of the cross-entropy is finite and equals the
    closed form d/dx_i = s'(x_i) / S - [i = y] s'(x_i) / s(x_i) (s' = 1 for x >= 0, s^2 below,
    S = sum s) in Python floats: rtol 1e-12 of the two terms' magnitudes (the difference
    cancels when one logit dominates), plus one float32 rounding for float32 logits."""
    dtype, rows = data
    x = torch.tensor(rows, dtype=dtype, requires_grad=True)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(x.shape[-1], x.shape[:-1], generator=gen)
    labels[torch.rand(labels.shape, generator=gen) < 0.3] = -100
    (grad,) = torch.autograd.grad(stablemax_cross_entropy(x, labels).sum(), (x,))
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    for row, y, g in zip(x.detach().double().tolist(), labels.tolist(), grad.double(),
                         strict=True):
        s = [v + 1.0 if v >= 0 else 1.0 / (1.0 - v) for v in row]
        ds = [1.0 if v >= 0 else si * si for v, si in zip(row, s, strict=True)]
        total = math.fsum(s)
        if y == -100:
            assert (g == 0).all()
            continue
        first = torch.tensor([d / total for d in ds], dtype=torch.float64)
        second = torch.tensor([ds[i] / s[i] if i == y else 0.0 for i in range(len(row))],
                              dtype=torch.float64)
        want = first - second
        allowed = 1e-12 * (first.abs() + second.abs())
        if dtype == torch.float32:
            allowed = allowed + F32_EPS * want.abs() + 2.0**-149
        assert ((g - want).abs() <= allowed).all()


# ============================================================================ streaming top-k
PALETTES = {
    "ties": [-1.0, 0.0, -0.0, 0.5],
    "ties_inf": [-1.0, 0.0, -0.0, 0.5, math.inf, -math.inf],
    "infs": [math.inf, -math.inf, 0.0],
}


@st.composite
def topk_cases(draw) -> dict:
    """A ``[T, M]`` stream (T up to 40, possibly 0) of values from a tiny palette (many ties,
    -0.0 beside 0.0, +-inf) or normal floats mixed with the palette, shuffled unique positions
    (a permutation of 0..T-1 or sparse up to 2**32 - 1, the extremes included), cut into
    chunks at random (empty chunks and chunks larger than k included), k up to 12."""
    rows = draw(st.integers(0, 40))
    if draw(st.booleans()):
        positions = list(range(rows))
    else:
        positions = draw(st.lists(st.integers(0, 2**32 - 1), min_size=rows, max_size=rows,
                                  unique=True))
        if rows >= 2 and draw(st.booleans()):
            positions[:2] = [0, 2**32 - 1]
            positions = list(dict.fromkeys(positions))
            while len(positions) < rows:  # an extreme collided with a drawn position
                positions.append(draw(st.integers(1, 2**32 - 2).filter(
                    lambda p: p not in positions)))
    cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=8)))
    return dict(rows=rows, columns=draw(st.integers(1, 4)), k=draw(st.integers(1, 12)),
                palette=draw(st.sampled_from(sorted(PALETTES) + ["normal"])),
                positions=draw(st.permutations(positions)), cuts=cuts,
                dtype=draw(st.sampled_from([torch.float32, torch.float64])),
                seed=draw(st.integers(0, 2**31 - 1)))


def build_topk(case: dict) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["rows"], case["columns"])
    palette = torch.tensor(PALETTES.get(case["palette"], PALETTES["ties_inf"]))
    matrix = palette[torch.randint(len(palette), shape, generator=gen)]
    if case["palette"] == "normal":  # normal floats, a quarter of the entries from the palette
        matrix = torch.where(torch.rand(shape, generator=gen) < 0.25, matrix,
                             torch.randn(shape, generator=gen))
    return matrix.to(case["dtype"])


def python_topk(matrix: torch.Tensor, positions: list[int], k: int):
    """Per column: (value, position) sorted by value descending, then position ascending, in
    plain Python (0.0 == -0.0 compare equal, so they tie)."""
    values, where = [], []
    for column in matrix.to(torch.float32).T.tolist():
        ranked = sorted(zip(column, positions, strict=True), key=lambda e: (-e[0], e[1]))[:k]
        values.append([v for v, _ in ranked])
        where.append([p for _, p in ranked])
    take = min(k, matrix.shape[0])
    return (torch.tensor(values, dtype=torch.float32).reshape(matrix.shape[1], take),
            torch.tensor(where, dtype=torch.int64).reshape(matrix.shape[1], take))


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal shapes, dtypes and values, signs of zeros included."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a, b)
    if a.is_floating_point():
        assert torch.equal(torch.signbit(a), torch.signbit(b))


@settings(max_examples=150, deadline=None, derandomize=False, print_blob=True)
@given(case=topk_cases())
@example(case=dict(rows=6, columns=2, k=2, palette="ties", positions=[5, 4, 3, 2, 1, 0],
                   cuts=[0, 0, 3, 6, 6], dtype=torch.float32, seed=0))
def test_streaming_topk_equals_the_reference(case):
    """Whatever the chunking, ties, signed zeros, infinities, position order and k (also above
    the stream's length), the streamed top-k equals ``topk_reference`` and a plain Python sort
    exactly: values (sign of zero included) and positions, best first, ties to the smaller
    position; ``rows_seen`` counts every row."""
    matrix = build_topk(case)
    positions = torch.tensor(case["positions"], dtype=torch.int64)
    k = case["k"]
    top = StreamingTopK(case["columns"], k)
    bounds = [0, *case["cuts"], case["rows"]]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        top.update(matrix[lo:hi], positions[lo:hi])
    values, where = top.result()
    assert top.rows_seen == case["rows"]
    ref_values, ref_where = topk_reference(matrix, positions, k)
    assert_identical(values, ref_values)
    assert_identical(where, ref_where)
    py_values, py_where = python_topk(matrix, case["positions"], k)
    assert_identical(values, py_values)
    assert_identical(where, py_where)


@settings(max_examples=60, deadline=None, derandomize=False, print_blob=True)
@given(case=topk_cases(), at=st.integers(0, 10**6))
def test_streaming_topk_rejects_nan_and_keeps_its_state(case, at):
    """A chunk holding a NaN raises ValueError and leaves the state as it was: the stream then
    goes on, and the result equals the reference of the stream without that chunk."""
    matrix = build_topk(case)
    if case["rows"] == 0:
        matrix = torch.zeros(1, case["columns"], dtype=case["dtype"])
        case = {**case, "rows": 1, "positions": [7], "cuts": []}
    positions = torch.tensor(case["positions"], dtype=torch.int64)
    bounds = [0, *case["cuts"], case["rows"]]
    spans = [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
    bad_lo, bad_hi = spans[at % len(spans)]
    poisoned = matrix.clone()
    poisoned.view(-1)[bad_lo * case["columns"]
                      + at % ((bad_hi - bad_lo) * case["columns"])] = math.nan
    top = StreamingTopK(case["columns"], case["k"])
    kept = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if (lo, hi) == (bad_lo, bad_hi):
            before = top.result(), top.rows_seen
            with pytest.raises(ValueError, match="NaN"):
                top.update(poisoned[lo:hi], positions[lo:hi])
            after = top.result(), top.rows_seen
            assert before[1] == after[1]
            for a, b in zip(before[0], after[0], strict=True):
                assert_identical(a, b)
            continue
        top.update(matrix[lo:hi], positions[lo:hi])
        kept.append(torch.arange(lo, hi))
    kept = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64)
    values, where = top.result()
    ref_values, ref_where = topk_reference(matrix[kept], positions[kept], case["k"])
    assert_identical(values, ref_values)
    assert_identical(where, ref_where)
