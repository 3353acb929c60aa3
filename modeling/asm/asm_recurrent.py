"""The recurrent (one position at a time) form of the ASM kernels in PyTorch: the decode step.

The same maths as the chunk forms for ``T = 1`` in a few small ops, continuing a
:class:`~.asm_common.ScanState` (tested against the chunk forms).
"""

from __future__ import annotations

import math

import torch

from .asm_common import TINY, Refine, ScanState

__all__ = ["asa_attend_step", "causal_linear_attention_step"]


def asa_attend_step(
    logits: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    key_logits: torch.Tensor,
    gamma: torch.Tensor | float,
    read_temperature: float = 1.0,
    refine: Refine | None = None,
    state: ScanState | None = None,
    gate: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ScanState]:
    """One position of :func:`asa_attend_chunk_autograd` (``T = 1``, same arguments and results):
    the
    decode step, in a few small ops.

    With ``c = max(m, l)`` (0 before a slot's first write) the state becomes
    ``den' = den e^(m - c) + e^(l - c)``, ``num' = num e^(m - c) + e^(l - c) v``; the slots are
    ``num' / max(den', 1)``: ``den' >= 1`` once a slot is written (its largest term is
    ``e^0``) and ``den' = num' = 0`` before, where a slot reads zero.
    """
    b, h, _, k = logits.shape
    dt = torch.promote_types(logits.dtype, torch.float32)
    if state is None:
        state = ScanState.empty(b, h, k, v.shape[-1], v.device, dt)
    m, den, num = state.m, state.den, state.num
    if not (logits.dtype == v.dtype == q.dtype == key_logits.dtype == m.dtype == den.dtype
            == num.dtype == dt):
        logits, v, q, key_logits, m, den, num = (
            x.to(dt) for x in (logits, v, q, key_logits, m, den, num))
    lg = logits[:, :, 0]  # [B, H, K]
    mu = torch.maximum(m, lg)
    c = mu.nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0)  # -inf -> 0, else mu
    carry, e = torch.exp(m - c), torch.exp(lg - c)
    den = torch.addcmul(e, den, carry)
    num = torch.addcmul(num * carry.unsqueeze(-1), e.unsqueeze(-1), v)
    slots = num / den.clamp_min(1.0).unsqueeze(-1)  # [B, H, K, d]
    if isinstance(gamma, torch.Tensor):
        if gamma.dim() == 1:
            gamma = gamma.view(1, -1, 1, 1)
        read = torch.addcmul(key_logits, q @ slots.transpose(-1, -2),
                             gamma if gamma.dtype == dt else gamma.to(dt))  # [B, H, 1, K]
    elif gamma == 0.0:  # no content read (the term is 0 with finite slots and q)
        read = key_logits
    else:
        read = key_logits + gamma * (q @ slots.transpose(-1, -2))
    r = torch.softmax(read if read_temperature == 1.0 else read / read_temperature, dim=-1)
    final = ScanState(m=mu, den=den, num=num)
    if refine is None:
        return r @ slots, r, None, final
    w = refine(r)
    if w.dtype != dt:
        w = w.to(dt)
    if gate is not None:
        if not isinstance(gate, torch.Tensor):
            gate = torch.as_tensor(gate, dtype=dt)
        return torch.addcmul(r, gate if gate.dtype == dt else gate.to(dt), w) @ slots, r, \
            None, final
    return r @ slots, r, w @ slots, final


def causal_linear_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One position of :func:`causal_linear_attention_chunk_autograd` (``T = 1``, same arguments and
    results): ``S' = S + phi_k^T v``, ``Z' = Z + phi_k``, ``out = phi_q S' / (phi_q . Z')``
    (0 while ``phi_q . Z' = 0``, nothing written)."""
    dt = torch.promote_types(phi_q.dtype, torch.float32)
    if state is None:
        b, h, _, mm = phi_q.shape
        state = (torch.zeros(b, h, mm, v.shape[-1], device=v.device, dtype=dt),
                 torch.zeros(b, h, mm, device=v.device, dtype=dt))
    s, z = state
    if not phi_q.dtype == phi_k.dtype == v.dtype == s.dtype == z.dtype == dt:
        phi_q, phi_k, v, s, z = (x.to(dt) for x in (phi_q, phi_k, v, s, z))
    s = torch.addcmul(s, phi_k.transpose(-1, -2), v)  # [B, H, M, M]
    z = z + phi_k[:, :, 0]
    # phi_q . Z' is 0 only where nothing was written (then phi_q S' = 0 too) or subnormal
    # (where the naive form's reciprocal overflows): the floor keeps the read finite.
    return (phi_q @ s) / (phi_q @ z.unsqueeze(-1)).clamp_min(TINY[dt]), (s, z)
