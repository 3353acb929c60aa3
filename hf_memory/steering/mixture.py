"""The bank-level attention mixture of memory inception (paper eq. 4–5, 8–9), in float32 or wider.

At a steered site the prompt/history keys form bank 0 and every memory bank b competes through
its evidence β_b; the output is o* = Σ_b π_b o_b with π = softmax(β). With size normalisation::

    β_x = log mean_j exp(s_j^x)                         (prompt, over the T_t visible keys)
    β_b = log mean_m exp(s_m^b) + c_b                    (memory bank b, M_b slots)
    c_+ = ρ_ℓ λ_+ σ(γΔ),  c_- = −ρ_ℓ λ_- σ(−γΔ),  c_aux = ρ_ℓ λ_aux,
    Δ   = log mean exp(s^+) − log mean exp(s^-)          (eq. 8)

A target bank without a reference bank gets gate 1 (c_+ = ρ_ℓ λ_+), and vice versa. Without size
normalisation the log-means become log-sums (plain concatenated attention, eq. 2, when all c = 0).
This equals one softmax over the concatenated keys with bias c_b − log M_b on bank b's columns
and −log T_t on the prompt's (appendix G.1), which is how it is computed here (one score
matrix, one softmax, two reads: few kernel launches per decode step); the tests check it
against an independent repeat-KV implementation of that softmax.

Grouped-query attention is computed per KV group: queries ``[B, KVH, G, T, D]`` against keys
``[B, KVH, S, D]`` and bank slots ``[KVH, M, D]``; KV heads are never repeated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BankStack", "HeadSlots", "PreparedBank", "bank_mixture", "bank_mixture_by_lse",
           "bank_mixture_over", "history_bias", "toward", "visible_keys"]


@dataclass(frozen=True)
class PreparedBank:
    """One bank at one layer, ready to score.

    Attributes:
        role: ``"target"``, ``"reference"`` or ``"auxiliary"``.
        keys: scoring keys ``[KVH, M, D]`` in the compute dtype (canonical, or rotated by a
            phase/position).
        values: ``[KVH, M, D]`` in the compute dtype.
        gain: λ of the bank.
        post_rope_query: score against the post-RoPE query (slots placed at absolute positions)
            instead of the pre-RoPE one.
    """

    role: str
    keys: torch.Tensor
    values: torch.Tensor
    gain: float
    post_rope_query: bool = False


@dataclass(frozen=True)
class BankStack:
    """The banks of one steered layer, concatenated along slots, with their static biases.

    Attributes:
        keys, values: ``[KVH, M_total, D]``.
        bias: per slot column, the part of c_b − log M_b known before any query: −log M_b (when
            size-normalised) plus ρ·λ for auxiliary banks and for a target or reference bank
            without its counterpart.
        post_columns: ``[M_total]`` bool, slots scored with the post-RoPE query (None: none).
        column_bank: ``[M_total]`` the bank index of each column (for routing masses).
        gate: ``(target slice, reference slice, ρλ₊, ρλ₋, log M₊, log M₋)`` when both a target
            and a reference bank are present (their gains depend on the query, eq. 8–9).
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    post_columns: torch.Tensor | None
    column_bank: torch.Tensor
    gate: tuple | None
    num_banks: int

    @classmethod
    def of(cls, banks: list[PreparedBank], *, rho: float, size_normalize: bool) -> BankStack:
        roles = [bank.role for bank in banks]
        contrastive = "target" in roles and "reference" in roles
        sizes = [bank.keys.shape[1] for bank in banks]
        starts = [sum(sizes[:i]) for i in range(len(banks))]
        keys = torch.cat([bank.keys for bank in banks], dim=1)
        bias = torch.empty(sum(sizes), dtype=keys.dtype, device=keys.device)
        gate = [None, None, 0.0, 0.0, 0.0, 0.0]
        for i, bank in enumerate(banks):
            columns = slice(starts[i], starts[i] + sizes[i])
            log_size = math.log(sizes[i])
            static = -log_size if size_normalize else 0.0
            if bank.role == "auxiliary" or not contrastive:
                sign = -1.0 if bank.role == "reference" else 1.0
                static += sign * rho * bank.gain
            else:
                slot = 0 if bank.role == "target" else 1
                gate[slot], gate[2 + slot], gate[4 + slot] = columns, rho * bank.gain, log_size
            bias[columns] = static
        post = torch.cat([torch.full((n,), bank.post_rope_query, device=keys.device)
                          for bank, n in zip(banks, sizes, strict=True)])
        column_bank = torch.cat([torch.full((n,), i, device=keys.device)
                                 for i, n in enumerate(sizes)])
        return cls(keys=keys, values=torch.cat([bank.values for bank in banks], dim=1),
                   bias=bias, post_columns=post if post.any() else None,
                   column_bank=column_bank, gate=tuple(gate) if contrastive else None,
                   num_banks=len(banks))


def toward(plain: torch.Tensor, mixed: torch.Tensor, strength: float) -> torch.Tensor:
    """The strength dial: ``plain`` moved the fraction ``strength`` of the way to ``mixed`` (in
    ``mixed``'s dtype; 1 returns ``mixed`` itself). Every runtime steers through this."""
    if strength == 1.0:
        return mixed
    plain = plain.to(mixed.dtype)
    return plain + strength * (mixed - plain)


def visible_keys(
    attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean visibility ``[B|1, 1|H, T, S]`` from whatever mask the stock model passed.

    ``None`` from the model means a causal mask with no padding (SDPA's skip), aligned to the
    last key; a boolean mask is True where attending; a float mask is additive (0 keeps).
    Returns None when every key is visible (a single query with no mask: plain decoding).
    """
    if attention_mask is None and q_len == 1:
        return None
    if attention_mask is None:
        rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]
    mask = attention_mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention logit soft-capping (``softcap · tanh(s / softcap)``); None leaves scores."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, T, D]`` → ``[B, KVH, G, T, D]`` (a view)."""
    b, h, t, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, t, d)


def _by_history(q: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Grouped queries ``[B, KVH, G, T, D]`` times history ``[B, KVH, S, D]`` transposed:
    ``[B, KVH, G, T, S]`` as one batched product over (B, KVH), the G·T queries of a KV head
    stacked as rows (broadcasting over G would copy every key G times)."""
    b, kv_heads, g, t, d = q.shape
    scores = q.reshape(b, kv_heads, g * t, d) @ key.transpose(-1, -2)
    return scores.view(b, kv_heads, g, t, -1)


def _by_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[B, KVH, G, T, N]`` times per-KV-head ``[KVH, N, E]`` → ``[B, KVH, G, T, E]``, one
    batched product over KVH with the B·G·T rows stacked (bank slots are shared by every row)."""
    b, kv_heads, g, t, n = x.shape
    rows = x.transpose(0, 1).reshape(kv_heads, b * g * t, n)
    return (rows @ slots).view(kv_heads, b, g, t, -1).transpose(0, 1)


def _prompt_scores(qx, key, visible, size_normalize: bool, softcap: float | None):
    """Scores of grouped, scaled queries ``[B, KVH, G, T, D]`` against the prompt/history keys
    ``[B, KVH, S, D]``: capped, masked (−inf where not visible) and, when size-normalised, less
    log T_t (the count of visible keys)."""
    prompt = _capped(_by_history(qx, key), softcap)
    if visible is None:
        return prompt - math.log(key.shape[2]) if size_normalize else prompt
    if visible.shape[1] == 1:
        mask = visible[:, :, None]
    else:
        mask = visible.reshape(visible.shape[0], key.shape[1], -1, *visible.shape[-2:])
    prompt = prompt.masked_fill(~mask, float("-inf"))
    if size_normalize:
        prompt = prompt - mask.sum(dim=-1, keepdim=True).clamp(min=1).to(prompt.dtype).log()
    return prompt


def _slot_scores(q_pre, qx, stack: BankStack, *, scaling: float, gamma: float,
                 softcap: float | None):
    """Bank-slot logits ``[B, KVH, G, T, M]``: each slot's capped score plus its static bias and,
    for a target/reference pair, the query-dependent gate (eq. 8–9)."""
    kv_heads = stack.keys.shape[0]
    slot_keys = stack.keys.transpose(-1, -2)
    raw = _by_rotation(
        lambda: _by_slots(_grouped(q_pre.to(stack.keys.dtype), kv_heads) * scaling, slot_keys),
        lambda: _by_slots(qx, slot_keys), stack.post_columns)
    return _gated(_capped(raw, softcap), stack, gamma)


def _by_rotation(pre, post, post_columns: torch.Tensor | None) -> torch.Tensor:
    """Raw slot scores ``[..., M]`` from the products with the pre-RoPE queries (``pre()``) and
    the post-RoPE ones (``post()``): each slot column takes the one its keys were stored for
    (``post_columns``; None: every column pre-RoPE). Only the products needed are made."""
    if post_columns is None:
        return pre()
    raw = post()
    return raw if bool(post_columns.all()) else torch.where(post_columns, raw, pre())


def _gated(raw: torch.Tensor, stack: BankStack, gamma: float) -> torch.Tensor:
    """Slot logits from capped slot scores ``[..., M]``: the static biases and, for a
    target/reference pair, the query-dependent gate (eq. 8–9)."""
    slots = raw + stack.bias
    if stack.gate is not None:
        target, reference, target_gain, reference_gain, log_target, log_reference = stack.gate
        gap = ((torch.logsumexp(raw[..., target], -1) - log_target)
               - (torch.logsumexp(raw[..., reference], -1) - log_reference))
        adjust = torch.zeros_like(slots)
        adjust[..., target] = (target_gain * torch.sigmoid(gamma * gap))[..., None]
        adjust[..., reference] = -(reference_gain * torch.sigmoid(-gamma * gap))[..., None]
        slots = slots + adjust
    return slots


def bank_mixture(
    q_pre: torch.Tensor,
    q_post: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    stack: BankStack,
    *,
    scaling: float,
    gamma: float = 1.0,
    size_normalize: bool = True,
    with_routing: bool = False,
    softcap: float | None = None,
    per_slot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steered attention output for every query head, in the banks' compute dtype.

    Computed as one softmax over [prompt keys ; bank slots] with bias −log T_t on the prompt
    columns and c_b − log M_b on bank b's (appendix G.1), which equals the bank-level mixture
    o* = Σ_b π_b o_b. The compute dtype is float32 for half-precision and float32 models,
    float64 for float64 models.

    Args:
        q_pre: pre-RoPE queries ``[B, H, T, D]``.
        q_post: post-RoPE queries ``[B, H, T, D]`` (what the stock attention receives).
        key, value: prompt/history keys and values ``[B, KVH, S, D]`` (keys post-RoPE).
        visible: boolean ``[B|1, 1|H, T, S]``, or None when every key is visible.
        stack: the banks at this layer (:meth:`BankStack.of`, which holds ρ_ℓ and the gains).
        scaling: the model's score scale (1/√D).
        gamma: gate sharpness γ.
        size_normalize: subtract log T_t from the prompt evidence (eq. 9); the banks' −log M_b
            is part of ``stack.bias``.
        with_routing: also return the routing masses π.
        softcap: the model's attention logit soft-cap (Gemma 2): every scaled score ``s``, of
            history and bank slots alike, becomes ``softcap · tanh(s / softcap)`` before masks
            and biases, as the stock attention caps the prompt's.
        per_slot: the routing per slot column instead of per bank.

    Returns:
        ``(output [B, H, T, D], routing [B, H, T, 1 + n_banks] or None)``: column 0 of the
        routing is the prompt bank, column 1 + i the i-th bank (``per_slot``: the i-th slot
        column of ``stack``, ``[B, H, T, 1 + M_total]``).
    """
    kv_heads = key.shape[1]
    batch, heads, q_len, _ = q_post.shape
    dtype = stack.keys.dtype
    qx = _grouped(q_post.to(dtype), kv_heads) * scaling
    prompt = _prompt_scores(qx, key.to(dtype), visible, size_normalize, softcap)
    slots = _slot_scores(q_pre, qx, stack, scaling=scaling, gamma=gamma, softcap=softcap)
    weights = torch.softmax(torch.cat([prompt, slots], dim=-1), dim=-1)
    span = key.shape[2]
    b, kv_heads, g, t, _ = weights.shape
    mixed = ((weights[..., :span].reshape(b, kv_heads, g * t, span) @ value.to(dtype))
             .view(b, kv_heads, g, t, -1) + _by_slots(weights[..., span:], stack.values))
    routing = None
    if with_routing:
        per_bank = weights[..., span:]
        if not per_slot:
            per_bank = weights.new_zeros(*weights.shape[:-1], stack.num_banks)
            per_bank.index_add_(-1, stack.column_bank, weights[..., span:])
        routing = torch.cat([weights[..., :span].sum(-1, keepdim=True), per_bank], dim=-1)
        routing = routing.reshape(batch, heads, q_len, -1)
    return mixed.reshape(batch, heads, q_len, -1), routing


def history_bias(
    visible: torch.Tensor | None,
    *,
    batch: int,
    span: int,
    kv_heads: int,
    heads: int,
    size_normalize: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The additive bias :func:`bank_mixture_over` puts on the history's scaled scores: −inf
    where a key is hidden, and −log T_t (the row's count of visible keys) where it is seen when
    size-normalised, else 0. Laid out as its score rows ``[KVH·B, G·T, S]`` (KV-head major, a KV
    group's G query heads of T tokens each), or ``[1, 1, 1]`` when ``visible`` is None (every one
    of the ``span`` keys seen by every query); the vLLM worker makes it once per forward pass for
    all its steered layers.

    ``visible``: boolean ``[B|1, 1|H, T, S]`` (True: attended), ``B`` = ``batch``.
    """
    if visible is None:
        shift = -math.log(span) if size_normalize else 0.0
        return torch.full((1, 1, 1), shift, dtype=dtype)
    t, g = visible.shape[2], heads // kv_heads
    if visible.shape[1] == 1:  # every head alike: [1, B|1, 1, T, S]
        seen = visible.transpose(0, 1)[:, :, None]
    else:  # [KVH, B|1, G, T, S]
        seen = visible.view(visible.shape[0], kv_heads, g, t, span).transpose(0, 1)
    seen = seen.expand(kv_heads, batch, g, t, span)
    shift = torch.zeros((), dtype=dtype, device=visible.device)
    if size_normalize:
        shift = -seen.sum(-1, keepdim=True).clamp(min=1).to(dtype).log()
    return torch.where(seen, shift, float("-inf")).reshape(kv_heads * batch, g * t, span)


def bank_mixture_over(
    history: torch.Tensor,
    q_pre: torch.Tensor,
    q_post: torch.Tensor,
    key: torch.Tensor,
    bias: torch.Tensor,
    stack: BankStack,
    *,
    scaling: float,
    gamma: float = 1.0,
    softcap: float | None = None,
    strength: float = 1.0,
) -> torch.Tensor:
    """:func:`bank_mixture`'s output when the stock attention over the history is already known,
    moved the fraction ``strength`` of the way from ``history`` (``toward(history, ·, strength)``,
    folded into the mixture's last product).

    ``history`` is the stock attention's output (softmax over the visible, capped history scores,
    times the history values). The prompt bank's routing mass is the sum of its columns' weights
    in the one softmax over [history scores − log T_t ; slot logits], and its output is
    ``history`` itself: the history's values are never read again.
    Equal to :func:`bank_mixture` up to rounding (the tests compare them); the vLLM worker uses it
    on vLLM's own attention output, once per steered layer and decoding step, so it is written
    for few ops and takes every operand KV-head major, the layout in which the worker gathers its
    cache: ``history``, ``q_pre``, ``q_post`` ``[KVH, B, G·T, D]`` (row ``g·T + t``: query head
    ``kv·G + g`` at token ``t``), ``key`` ``[KVH, B, S, D]``; the output is laid out as
    ``history``. The mask and the size normalisation's −log T_t enter the history's product as
    one additive ``bias`` (:func:`history_bias`, made once per pass). Operands in another dtype
    than the banks' are cast to it.
    """
    kv_heads, b, rows, d = q_post.shape
    span = key.shape[2]
    dtype = stack.keys.dtype

    def flat(x: torch.Tensor, *shape: int) -> torch.Tensor:  # a view when x is contiguous
        return (x if x.dtype == dtype else x.to(dtype)).reshape(shape)

    keys_t = flat(key, kv_heads * b, span, d).transpose(-1, -2)
    if softcap is None:  # scale, mask and −log T_t in one kernel
        prompt = torch.baddbmm(bias, flat(q_post, kv_heads * b, rows, d), keys_t, alpha=scaling)
    else:
        prompt = _capped(torch.bmm(flat(q_post, kv_heads * b, rows, d), keys_t) * scaling,
                         softcap) + bias

    slot_keys = stack.keys.transpose(-1, -2)
    if stack.post_columns is None and softcap is None and stack.gate is None:
        slots = torch.baddbmm(stack.bias, flat(q_pre, kv_heads, b * rows, d), slot_keys,
                              alpha=scaling)  # one kernel
    else:
        def scores(x: torch.Tensor) -> torch.Tensor:  # [KVH, B·G·T, M]
            return torch.bmm(flat(x, kv_heads, b * rows, d), slot_keys) * scaling

        raw = _by_rotation(lambda: scores(q_pre), lambda: scores(q_post), stack.post_columns)
        slots = _gated(_capped(raw, softcap), stack, gamma)
    # one softmax over [history ; slots]; the history's columns are summed to its mass and its
    # output is vLLM's (the softmax is one fused kernel, cheaper than a separate log-sum-exp)
    weights = torch.softmax(torch.cat([prompt.view(kv_heads, b * rows, span), slots], -1), -1)
    mass = weights[..., :span].sum(-1, keepdim=True)
    # toward(h, w0 h + Σ w_m v_m, s) = (1 − s + s w0) h + s Σ w_m v_m
    keep = mass if strength == 1.0 else mass * strength + (1 - strength)
    mixed = torch.baddbmm(keep * flat(history, kv_heads, b * rows, d), weights[..., span:],
                          stack.values, alpha=strength)
    return mixed.view(kv_heads, b, rows, d)


@dataclass(frozen=True)
class HeadSlots:
    """A layer's bank slots gathered for a set of query heads, with the contrastive gate folded
    into two per-column constants: what :func:`bank_mixture_by_lse` needs, built once per
    steering (:meth:`of`) so that a decoding step gathers nothing.

    The gate adds ρλ₊σ(γΔ) to the target columns and −ρλ₋σ(−γΔ) = −ρλ₋ + ρλ₋σ(γΔ) to the
    reference ones, so the slot logits are ``raw + base + σ(γΔ) · swing`` with
    ``base = bias − ρλ₋·[reference]`` and ``swing = ρλ₊·[target] + ρλ₋·[reference]``.

    Attributes:
        keys_t: ``[Hs, D, M]`` each head's slot keys, transposed for the product.
        values: ``[Hs, M, D]``.
        base: ``[M]`` the static slot bias with the gate's constant part.
        swing: ``[M]`` the gate's per-column weight (None: no target/reference pair).
        target, reference: the two banks' column slices (None without the gate).
        gate_offset: log M₊ − log M₋ (Δ = lse₊ − lse₋ − gate_offset).
        post_columns: ``[M]`` bool, columns scored with the post-RoPE query (None: none).
        all_post: every column is (decided here, not by a device sync at each step).
    """

    keys_t: torch.Tensor
    values: torch.Tensor
    base: torch.Tensor
    swing: torch.Tensor | None
    target: slice | None
    reference: slice | None
    gate_offset: float
    post_columns: torch.Tensor | None
    all_post: bool

    @classmethod
    def of(cls, stack: BankStack, kv_index: torch.Tensor) -> HeadSlots:
        """``stack``'s slots for the query heads whose KV heads are ``kv_index`` ``[Hs]``."""
        base, swing, target, reference, offset = stack.bias, None, None, None, 0.0
        if stack.gate is not None:
            target, reference, target_gain, reference_gain, log_target, log_reference = (
                stack.gate)
            swing = torch.zeros_like(stack.bias)
            swing[target], swing[reference] = target_gain, reference_gain
            base = stack.bias.clone()
            base[reference] -= reference_gain
            offset = log_target - log_reference
        return cls(keys_t=stack.keys[kv_index].transpose(-1, -2).contiguous(),
                   values=stack.values[kv_index].contiguous(), base=base, swing=swing,
                   target=target, reference=reference, gate_offset=offset,
                   post_columns=stack.post_columns,
                   all_post=stack.post_columns is not None and bool(stack.post_columns.all()))


def bank_mixture_by_lse(
    history: torch.Tensor,
    lse: torch.Tensor,
    q_pre: torch.Tensor,
    q_post: torch.Tensor,
    slots: HeadSlots,
    *,
    scaling: float,
    log_count: torch.Tensor | float = 0.0,
    gamma: float = 1.0,
    size_normalize: bool = True,
    strength: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`bank_mixture`'s output from the stock attention's output over the history and its
    log-sum-exp, without touching the history's keys or values again.

    The mixture is one softmax over [history scores − log T_t ; slot logits]; the history's part
    of it enters as one column of logit ``lse − log T_t`` (its total evidence) and value
    ``history`` (its softmax read), so a steered layer costs the stock attention plus products
    with the bank slots, independent of the context length. Moved the fraction ``strength`` of
    the way from ``history`` as :func:`bank_mixture_over` does. Written for few kernels (a
    decoding step of a contrastive pair: about fifteen): nothing gathered per step, the gate as
    two constants (:class:`HeadSlots`), the history's weight and read in one ``addcmul``.

    Args:
        history: the stock attention's output ``[B, Hs, T, D]`` for the steered query heads, in
            the model's dtype.
        lse: the log-sum-exp of the history's scaled scores ``[B, Hs, T]``, −inf for a query row
            that sees no key (it reads the banks only).
        q_pre, q_post: pre- and post-RoPE queries ``[B, Hs, T, D]`` of those heads.
        slots: the banks at this layer for those heads (:meth:`HeadSlots.of`).
        log_count: log T_t, the log of each row's count of visible keys, broadcastable to
            ``[B, Hs, T]`` (used when ``size_normalize``).
        gamma, size_normalize: as in :func:`bank_mixture` (no soft-cap: callers with one use
            :func:`bank_mixture` or :func:`bank_mixture_over`).
        out_dtype: the output's dtype (None: the banks' compute dtype).

    Returns:
        ``[B, T, Hs, D]`` (the layout attention returns) in ``out_dtype``.
    """
    b, heads, t, d = q_post.shape
    dtype = slots.keys_t.dtype

    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, Hs, T, ·] → [Hs, B·T, ·] in dtype
        return x.transpose(0, 1).reshape(heads, b * t, x.shape[-1]).to(dtype)

    if slots.post_columns is None and slots.swing is None:  # one kernel
        slot_logits = torch.baddbmm(slots.base, rows(q_pre), slots.keys_t, alpha=scaling)
    else:
        def product(x):  # scaled raw scores (baddbmm ignores its first input at beta 0)
            return torch.baddbmm(slots.base, rows(x), slots.keys_t, beta=0.0, alpha=scaling)

        if slots.post_columns is None:
            raw = product(q_pre)
        elif slots.all_post:
            raw = product(q_post)
        else:
            raw = torch.where(slots.post_columns, product(q_post), product(q_pre))
        slot_logits = raw + slots.base
        if slots.swing is not None:
            gap = (torch.logsumexp(raw[..., slots.target], -1, keepdim=True)
                   - torch.logsumexp(raw[..., slots.reference], -1, keepdim=True))
            if slots.gate_offset:
                gap = gap - slots.gate_offset
            if gamma != 1.0:
                gap = gap * gamma
            slot_logits = torch.addcmul(slot_logits, torch.sigmoid(gap), slots.swing)
    evidence = lse.to(dtype).transpose(0, 1).reshape(heads, b * t, 1)
    if size_normalize:
        if isinstance(log_count, torch.Tensor):
            log_count = log_count.expand(b, heads, t).transpose(0, 1).reshape(heads, b * t, 1)
        evidence = evidence - log_count
    weights = torch.softmax(torch.cat([evidence, slot_logits], -1), -1)
    # toward(h, w0 h + Σ w_m v_m, s) = (1 − s + s w0) h + s Σ w_m v_m
    mass = weights[..., :1]
    keep = mass if strength == 1.0 else mass * strength + (1 - strength)
    read = torch.bmm(weights[..., 1:], slots.values)
    if strength != 1.0:
        read = read * strength
    mixed = torch.addcmul(read.view(heads, b, t, d), keep.view(heads, b, t, 1),
                          history.transpose(0, 1))
    return mixed.permute(1, 2, 0, 3).to(out_dtype or dtype, memory_format=torch.contiguous_format)
