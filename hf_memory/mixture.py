"""The bank-level attention mixture of memory inception (paper eq. 4–5, 8–9), in float32 or wider.

At a steered site the prompt/history keys form bank 0 and every memory bank b competes through
its evidence β_b; the output is o* = Σ_b π_b o_b with π = softmax(β). With size normalisation

    β_x = log mean_j exp(s_j^x)                         (prompt, over the T_t visible keys)
    β_b = log mean_m exp(s_m^b) + c_b                    (memory bank b, M_b slots)
    c_+ = ρ_ℓ λ_+ σ(γΔ),  c_- = −ρ_ℓ λ_- σ(−γΔ),  c_aux = ρ_ℓ λ_aux,
    Δ   = log mean exp(s^+) − log mean exp(s^-)          (eq. 8)

A target bank without a reference bank gets gate 1 (c_+ = ρ_ℓ λ_+), and vice versa. Without size
normalisation the log-means become log-sums (plain concatenated attention, eq. 2, when all c = 0).
This equals one softmax over the concatenated keys with bias c_b − log M_b on bank b's columns
and −log T_t on the prompt's (appendix G.1); the tests check it that way.

Grouped-query attention is computed per KV group: queries ``[B, KVH, G, T, D]`` against keys
``[B, KVH, S, D]`` and bank slots ``[KVH, M, D]``; KV heads are never repeated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["PreparedBank", "bank_mixture", "visible_keys"]


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


def visible_keys(
    attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """Boolean visibility ``[B|1, 1|H, T, S]`` from whatever mask the stock model passed.

    ``None`` means a causal mask with no padding (SDPA's skip), aligned to the last key;
    a boolean mask is True where attending; a float mask is additive (0 keeps).
    """
    if attention_mask is None:
        rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]
    mask = attention_mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, T, D]`` → ``[B, KVH, G, T, D]`` (a view)."""
    b, h, t, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, t, d)


def _masked_softmax_read(scores: torch.Tensor, values: torch.Tensor, equation: str):
    """Log-sum-exp over the last axis and the softmax-weighted read; all-masked rows give 0."""
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    weights = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None])
    weights = torch.where(finite[..., None], weights, 0.0)
    return lse, torch.einsum(equation, weights, values)


def bank_mixture(
    q_pre: torch.Tensor,
    q_post: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    banks: list[PreparedBank],
    *,
    scaling: float,
    rho: float = 1.0,
    gamma: float = 1.0,
    size_normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steered attention output for every query head, in the banks' compute dtype.

    The compute dtype is float32 for half-precision and float32 models, float64 for float64
    models: exact whatever the model dtype.

    Args:
        q_pre: pre-RoPE queries ``[B, H, T, D]``.
        q_post: post-RoPE queries ``[B, H, T, D]`` (what the stock attention receives).
        key, value: prompt/history keys and values ``[B, KVH, S, D]`` (keys post-RoPE).
        visible: boolean ``[B|1, 1|H, T, S]``.
        banks: the memory banks at this layer (may be empty).
        scaling: the model's score scale (1/√D).
        rho, gamma: layer gain ρ_ℓ and gate sharpness γ.
        size_normalize: subtract log T_t / log M_b from the evidence (eq. 5, 9).

    Returns:
        ``(output [B, H, T, D], routing [B, H, T, 1 + len(banks)])``: the mixed output and the
        routing mass π of the prompt bank followed by each memory bank.
    """
    kv_heads = key.shape[1]
    batch, heads, q_len, _ = q_post.shape
    dtype = torch.promote_types(q_post.dtype, torch.float32)
    qx = _grouped(q_post.to(dtype), kv_heads)
    scores = torch.einsum("bkgtd,bksd->bkgts", qx, key.to(dtype)) * scaling
    if visible.shape[1] == 1:
        mask = visible[:, :, None]
    else:
        mask = visible.reshape(visible.shape[0], kv_heads, -1, *visible.shape[-2:])
    scores = scores.masked_fill(~mask, float("-inf"))
    lse_x, out_x = _masked_softmax_read(scores, value.to(dtype), "bkgts,bksd->bkgtd")
    if size_normalize:
        count = mask.sum(dim=-1).expand_as(lse_x)
        beta_x = torch.where(count > 0, lse_x - count.clamp(min=1).to(dtype).log(), -math.inf)
    else:
        beta_x = lse_x

    evidence, outputs, log_means = [beta_x], [out_x], []
    for bank in banks:
        query = qx if bank.post_rope_query else _grouped(q_pre.to(dtype), kv_heads)
        s = torch.einsum("bkgtd,kmd->bkgtm", query, bank.keys) * scaling
        lse, out = _masked_softmax_read(s, bank.values, "bkgtm,kmd->bkgtd")
        log_mean = lse - math.log(bank.keys.shape[1])
        log_means.append(log_mean)
        outputs.append(out)
        evidence.append(log_mean if size_normalize else lse)

    roles = [bank.role for bank in banks]
    gap = None
    if "target" in roles and "reference" in roles:
        gap = log_means[roles.index("target")] - log_means[roles.index("reference")]
    for i, bank in enumerate(banks):
        if bank.role == "target":
            gate = 1.0 if gap is None else torch.sigmoid(gamma * gap)
            evidence[i + 1] = evidence[i + 1] + rho * bank.gain * gate
        elif bank.role == "reference":
            gate = 1.0 if gap is None else torch.sigmoid(-gamma * gap)
            evidence[i + 1] = evidence[i + 1] - rho * bank.gain * gate
        else:
            evidence[i + 1] = evidence[i + 1] + rho * bank.gain

    routing = torch.softmax(torch.stack(evidence, dim=-1), dim=-1)
    mixed = torch.einsum("bkgtn,nbkgtd->bkgtd", routing, torch.stack(outputs))
    return (mixed.reshape(batch, heads, q_len, -1),
            routing.reshape(batch, heads, q_len, len(evidence)))
