"""The naive forms of the ASM kernels: float64, O(T^2), written from the definitions.

The reference every faster form is tested against (fla's ``naive``): the slot states
``slot_s(t) = sum_{tau<=t} softmax_tau(l_{s,tau}) v_tau``, the scan + read, its two contractions,
and the causal linear attention. Shapes as in README.md beside this file.
"""

from __future__ import annotations

import torch

from .asm_common import Refine, safe_reciprocal

__all__ = ["asa_attend_naive", "causal_linear_attention_naive", "slot_addressing_naive",
           "slot_read_naive", "slot_scores_naive", "slot_states_naive"]


def slot_states_naive(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``slot_s(t) = sum_{tau<=t} softmax_tau(l_{s,tau}) v_tau`` in float64, O(T^2).

    ``logits [B, H, T, K]``, ``v [B, H, T, d]`` -> ``[B, H, T, K, d]``; a slot with no write yet
    is zero.
    """
    lg = logits.double()
    t = lg.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=lg.device).tril()  # [t, tau]
    scores = lg.unsqueeze(2).expand(-1, -1, t, -1, -1)  # [B, H, t, tau, K]
    scores = scores.masked_fill(~causal[None, None, :, :, None], float("-inf"))
    ref = scores.amax(dim=3, keepdim=True).detach()
    ref = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))
    weights = torch.exp(scores - ref)
    weights = weights * safe_reciprocal(weights.sum(dim=3, keepdim=True))
    return torch.einsum("bhtuk,bhud->bhtkd", weights, v.double())


def asa_attend_naive(
    logits: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    key_logits: torch.Tensor,
    gamma: torch.Tensor | float,
    read_temperature: float = 1.0,
    refine: Refine | None = None,
    gate: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Float64 reference of the scan + read.

    Args:
        logits: write logits ``[B, H, T, K]`` (``-inf`` at masked positions).
        v: values ``[B, H, T, d]``.
        q: content-read queries ``[B, H, T, d]`` (already scaled).
        key_logits: key term of the read logits ``[B, H, T, K]``.
        gamma: content-read weight, a scalar or ``[H]``.
        read_temperature: divides the read logits.
        refine: maps read weights ``[B, H, T, K]`` to signed slot weights ``[B, H, T, K]``.
        gate: with ``refine``, fuse the two reads into one contraction with ``r + gate * w``.

    Returns:
        ``(o [B, H, T, d], r [B, H, T, K], delta [B, H, T, d] or None)``; with ``gate``, ``o``
        is ``o + gate * delta`` and ``delta`` is None.
    """
    slots = slot_states_naive(logits, v)
    gamma = torch.as_tensor(gamma, dtype=torch.float64, device=v.device)
    gamma = gamma.view(1, -1, 1, 1) if gamma.dim() == 1 else gamma
    content = torch.einsum("bhtd,bhtkd->bhtk", q.double(), slots)
    r = torch.softmax((key_logits.double() + gamma * content) / read_temperature, dim=-1)
    o = torch.einsum("bhtk,bhtkd->bhtd", r, slots)
    if refine is None:
        return o, r, None
    w = refine(r).double()
    if gate is not None:
        gate = torch.as_tensor(gate, dtype=torch.float64, device=v.device)
        return torch.einsum("bhtk,bhtkd->bhtd", r + gate * w, slots), r, None
    return o, r, torch.einsum("bhtk,bhtkd->bhtd", w, slots)


def causal_linear_attention_naive(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Float64 O(T^2) causal linear attention: ``phi_q, phi_k, v [B, H, T, M]`` -> ``[B, H, T, M]``.

    A position whose normaliser ``phi_q . Z`` is 0 (nothing written yet) reads zero.
    """
    qd, kd, vd = phi_q.double(), phi_k.double(), v.double()
    t = qd.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=qd.device).tril()
    scores = (qd @ kd.transpose(-1, -2)).masked_fill(~causal, 0.0)
    return (scores @ vd) * safe_reciprocal(scores.sum(dim=-1, keepdim=True))


def slot_read_naive(a: torch.Tensor, logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 reference of :func:`slot_read_fused_recurrent`: ``[B, H, T, d]``."""
    return torch.einsum("bhtk,bhtkd->bhtd", a.double(), slot_states_naive(logits, v))


def slot_scores_naive(x: torch.Tensor, logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 reference of :func:`slot_scores_fused_recurrent`: ``[B, H, T, K]``."""
    return torch.einsum("bhtd,bhtkd->bhtk", x.double(), slot_states_naive(logits, v))


def slot_addressing_naive(
    key: torch.Tensor,
    q: torch.Tensor,
    slot_keys: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    positions: torch.Tensor,
    valid: torch.Tensor,
    recency: torch.Tensor | None,
    write_scale: float,
    read_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, key_logits)`` ``[B, H, T, K]`` from the definitions, in plain PyTorch
    (autograd's backward), in ``promote_types(key.dtype, float32)`` (float64 for a reference):
    the write key rotated by the half-split tables ``(cos, sin)`` ``[B, 1, T, d]``,
    ``logits = write_scale <rot(key), slot> + recency[h] position`` (``-inf`` at padding),
    ``key_logits = read_scale <q, slot>``; ``key, q [B, H, T, d]``, ``slot_keys [H, K, d]``,
    ``positions, valid [B, T]``, ``recency [H]`` or None. The operations of the unfused
    ``ASAAttention.forward`` before issue 81."""
    dt = torch.promote_types(key.dtype, torch.float32)
    if rotary is not None:
        cos, sin = (y.to(key.dtype) for y in rotary)
        key = key * cos + key.roll(key.shape[-1] // 2, dims=-1) * sin
    logits = torch.einsum("bhtd,hkd->bhtk", key, slot_keys).to(dt) * write_scale
    if recency is not None:
        logits = logits + recency.to(dt)[None, :, None, None] * positions.to(dt)[:, None, :, None]
    logits = logits.masked_fill(~valid[:, None, :, None], float("-inf"))
    key_logits = (torch.einsum("bhtd,hkd->bhtk", q, slot_keys) * read_scale).to(dt)
    return logits, key_logits
