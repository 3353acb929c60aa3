"""Addressed State Attention kernels: float64 references and exact chunk-parallel PyTorch forms.

Shapes: ``B`` batch, ``H`` heads, ``T`` positions, ``K`` slots, ``d`` head width, ``M`` slot-space
width. Masked (padding) positions carry write logits of ``-inf`` and write nothing.

* ``asa_attend`` (the scan + read): per-slot running log-sum-exp scan of the write logits, read
  weights ``r = softmax((key_logits + gamma * <q, slot(t)>) / read_temperature)``, an optional
  refinement ``w = refine(r)`` and the contractions ``o = sum_s r slot_s(t)``,
  ``delta = sum_s w slot_s(t)``. The chunked form never materialises ``[B, H, T, K, d]``: inside a
  chunk all terms of one position share one reference per slot (the chunk's max
  ``c = max(m_prev, max over the chunk)``, lowered in steps of about 40 for positions whose
  running max is far below it, so no denominator underflows), so it is exact and independent of
  the chunk size.
* ``causal_linear_attention``: ``out_t = phi_q_t S_t / (phi_q_t . Z_t)`` with
  ``S_t = sum_{tau<=t} phi_k_tau v_tau^T`` and ``Z_t = sum_{tau<=t} phi_k_tau``.

``*_ref`` are the O(T^2) float64 references; ``*_chunked`` the PyTorch implementations (the
default on CPU). Both chunked forms take and return the recurrent state, so prefill, chunked
prefill and one-token decoding can run the same code; ``*_step`` are the same maths for one
position in a few small ops (the model's decode step), tested against the chunked forms.
``slot_scan_fwd_kernel`` / ``slot_scan_bwd_kernel`` are the Triton kernels of the scan + read
(``slot_read_triton``, ``slot_scores_triton``, ``asa_attend_triton``),
``linear_attn_fwd_kernel`` / ``linear_attn_bwd_kernel`` those of the slot-space linear attention
(``causal_linear_attention_triton``); ``asa_attend`` and ``causal_linear_attention``
dispatch. See README.md beside this file for the maths.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "ScanState",
    "asa_attend",
    "asa_attend_chunked",
    "asa_attend_ref",
    "asa_attend_step",
    "asa_attend_triton",
    "causal_linear_attention",
    "causal_linear_attention_chunked",
    "causal_linear_attention_ref",
    "causal_linear_attention_step",
    "causal_linear_attention_triton",
    "slot_read_ref",
    "slot_read_triton",
    "slot_scores_ref",
    "slot_scores_triton",
    "slot_states_ref",
]

Refine = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ScanState:
    """Running write state of one layer: true numerator ``N = num * exp(m)``, denominator
    ``D = den * exp(m)``.

    Attributes:
        m: running max of the write logits ``[B, H, K]`` (``-inf`` before any write).
        den: scaled denominators ``[B, H, K]``.
        num: scaled numerators ``[B, H, K, d]``.
    """

    m: torch.Tensor
    den: torch.Tensor
    num: torch.Tensor

    @classmethod
    def empty(cls, b: int, h: int, k: int, d: int, device: torch.device,
              dtype: torch.dtype) -> ScanState:
        return cls(
            m=torch.full((b, h, k), float("-inf"), device=device, dtype=dtype),
            den=torch.zeros(b, h, k, device=device, dtype=dtype),
            num=torch.zeros(b, h, k, d, device=device, dtype=dtype),
        )


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` where ``x > 0``, else 0 (an empty slot reads as zero; gradients stay finite)."""
    positive = x > 0
    return torch.where(positive, 1.0 / torch.where(positive, x, torch.ones_like(x)),
                       torch.zeros_like(x))


def slot_states_ref(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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
    weights = weights * _safe_reciprocal(weights.sum(dim=3, keepdim=True))
    return torch.einsum("bhtuk,bhud->bhtkd", weights, v.double())


def asa_attend_ref(
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
    slots = slot_states_ref(logits, v)
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


def _band_width(dtype: torch.dtype) -> float:
    """Width ``X`` of one reference band of the chunked scan, ``0.45 log(max float)``: about 40
    in float32, 319 in float64. Within a band ``1 / D <= e^X`` and its square (in the
    reciprocal's gradient) stay finite, and every term that can matter,
    ``e^(l - ref) >= e^(-X - 40)``, is a normal number."""
    return 0.45 * math.log(torch.finfo(dtype).max)


@dataclass
class _Bands:
    """Reference bands of the chunked scan for every position (see :func:`_scan_bands`)."""

    mu: torch.Tensor  # running max [B, H, T, K], -inf before a slot's first write
    level: torch.Tensor | None  # [B, H, T, K]: floor((c - mu) / X), c the chunk's reference
    rank: torch.Tensor | None  # [B, H, T, K] long: index of the position's band in its chunk
    count: list[int]  # bands per chunk


def _scan_bands(logits: torch.Tensor, m: torch.Tensor, step: int, width: float) -> _Bands:
    """Assign every position ``t`` of slot ``s`` to a reference band, one host sync in all.

    ``mu_s(t) = max(m_s, max_{tau<=t} l_{s,tau})`` and, in a chunk whose reference is
    ``c_s = mu_s(chunk end)``, ``level = floor((c_s - mu_s(t)) / X)``: position ``t`` is weighed
    against ``c_s - level X``, which lies within ``X`` above ``mu_s(t)``. ``level`` is
    non-increasing over a chunk; ``rank`` numbers its distinct values per slot from the chunk's
    end (rank 0 is level 0, the reference ``c_s`` itself), so a chunk needs
    ``max rank + 1 <= C`` bands however steep its logits (1 when its running max rises by less
    than ``X``).
    """
    t = logits.shape[2]
    mu = torch.maximum(m.unsqueeze(2), logits.detach().cummax(dim=2).values)
    if step == 1:
        return _Bands(mu, None, None, [1] * t)
    idx = torch.arange(t, device=mu.device)
    starts = idx // step * step
    ends = torch.clamp(starts + step - 1, max=t - 1)
    written = mu > float("-inf")
    level = torch.floor(torch.where(written, mu.index_select(2, ends) - mu,
                                    torch.zeros_like(mu)) / width)
    if not bool(level.any()):  # the usual case: one reference per chunk
        return _Bands(mu, None, None, [1] * ((t + step - 1) // step))
    change = torch.zeros_like(written)
    change[:, :, 1:] = (written[:, :, 1:] & written[:, :, :-1]
                        & (level[:, :, 1:] != level[:, :, :-1]))
    change &= (idx % step != 0)[:, None]
    seen = change.cumsum(dim=2)
    rank = seen.index_select(2, ends) - seen  # band changes after t: 0 at the chunk's end
    top = rank.amax(dim=(0, 1, 3))  # [T]
    top = torch.cat([top, top.new_zeros((-t) % step)]).view(-1, step).amax(dim=1)
    return _Bands(mu, level, rank, [int(x) + 1 for x in top.tolist()])


def asa_attend_chunked(
    logits: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    key_logits: torch.Tensor,
    gamma: torch.Tensor | float,
    read_temperature: float = 1.0,
    refine: Refine | None = None,
    chunk_size: int = 64,
    state: ScanState | None = None,
    gate: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ScanState]:
    """Exact chunk-parallel scan + read; same arguments and results as :func:`asa_attend_ref`,
    computed in ``float32`` or wider, plus the final :class:`ScanState`.

    Per chunk of ``C`` positions and slot ``s``: the chunk's reference
    ``c_s = max(m_s, max_chunk l)``, the running max ``mu_s(t)`` (the carried ``m_s`` included)
    and, for position ``t``, the banded reference ``ref_s(t) = c_s - X floor((c_s - mu_s(t)) / X)``
    (``X``: :func:`_band_width`, about 40 in float32), so ``mu_s(t) - ref_s(t)`` lies in
    ``(-X, 0]``. The distinct references of a chunk are its bands ``j = 0 .. J-1`` (band 0 is
    ``c``; ``J = 1`` unless the running max rises by ``X`` or more inside the chunk, and
    ``J <= C``). With ``E_j[tau, s] = exp(min(l[tau, s] - ref_{j,s}, 1))`` (the clamp only
    touches terms that no position of band ``j`` reads) and
    ``D_j(t) = den e^(m - ref_j) + sum_{tau<=t} E_j[tau]``, which is ``>= e^-X`` in band ``j``
    (no underflow, however steep the logits), and for any weights ``a``
    ``sum_s a_s slot_s(t) = sum_j [A_j(t) @ num e^(m - ref_j)
    + sum_{tau<=t} [A_j(t) @ E_j^T][tau] v_tau]`` with ``A_j = a / D_j`` in band ``j`` and 0
    elsewhere. Exact for any chunk size: every position's terms share one reference. The bands
    are one matmul over a ``J K`` inner dimension (``[C, C]`` and ``[C, J K]`` matrices per
    chunk, never ``[C, C, K]`` beyond ``J = C``); the references are detached (the result does
    not depend on them). Activations kept for the backward pass are ``O(T (C + J K))`` per head
    plus ``J`` ``[K, d]`` states per chunk.
    """
    b, h, t, k = logits.shape
    d = v.shape[-1]
    dt = torch.promote_types(logits.dtype, torch.float32)
    logits, v, q, key_logits = (x.to(dt) for x in (logits, v, q, key_logits))
    gamma = torch.as_tensor(gamma, dtype=dt, device=v.device)
    gamma = gamma.view(1, -1, 1, 1) if gamma.dim() == 1 else gamma
    if state is None:
        state = ScanState.empty(b, h, k, d, v.device, dt)
    m, den, num = state.m.to(dt), state.den.to(dt), state.num.to(dt)
    step = max(1, min(chunk_size, t))
    width = _band_width(dt)
    bands = _scan_bands(logits, m, step, width)
    upper = torch.ones(step, step, dtype=torch.bool, device=v.device).triu(1)
    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    reads: list[torch.Tensor] = []
    # chunks by split, not slicing: the backward of a split is one concatenation, where each
    # slice's backward would fill a zero tensor of the whole input
    v_chunks = v.split(step, dim=2)
    chunks = zip(logits.split(step, dim=2), v_chunks, q.split(step, dim=2),
                 key_logits.split(step, dim=2), strict=True)
    for i, (lc, vc, qc, kc) in enumerate(chunks):
        start = i * step
        n = lc.shape[2]
        end = start + n
        nb = bands.count[i]
        mu = bands.mu[:, :, start:end]  # [B, H, n, K], detached
        written = mu > float("-inf")
        c = mu[:, :, -1]
        c = torch.where(c > float("-inf"), c, 0.0)  # [B, H, K]
        if nb == 1:  # every position against c: l - c <= 0, nothing to clamp
            refs = c.unsqueeze(2)  # [B, H, 1, K]
            in_band = written.unsqueeze(3)
            carry = torch.exp(m.unsqueeze(2) - refs)  # 0 before the first write
            e = torch.exp(lc.unsqueeze(3) - refs.unsqueeze(2))
        else:
            rank = bands.rank[:, :, start:end]
            ref = torch.where(written, c.unsqueeze(2) - width * bands.level[:, :, start:end],
                              float("-inf"))
            refs = torch.full((b, h, nb, k), float("-inf"), device=v.device, dtype=dt)
            refs = refs.scatter_reduce(2, rank, ref, "amax")  # one value per (band, slot)
            refs = torch.where(refs > float("-inf"), refs, c.unsqueeze(2))  # [B, H, J, K]
            in_band = written.unsqueeze(3) & (rank.unsqueeze(3) == torch.arange(
                nb, device=v.device)[:, None])
            # the clamp only touches terms that no position of the band reads
            carry = torch.exp(torch.clamp(m.unsqueeze(2) - refs, max=1.0))
            e = torch.exp(torch.clamp(lc.unsqueeze(3) - refs.unsqueeze(2), max=1.0))
        # e [B, H, n, J, K]; in_band [B, H, n, J, K]
        denom = (den.unsqueeze(2) * carry).unsqueeze(2) + e.cumsum(dim=2)
        inv = torch.where(in_band, 1.0 / torch.where(in_band, denom, torch.ones_like(denom)),
                          torch.zeros_like(denom)).flatten(3)  # [B, H, n, J K]
        e = e.flatten(3)
        num_prev = (num.unsqueeze(2) * carry.unsqueeze(-1)).flatten(2, 3)  # [B, H, J K, d]
        qv = (qc @ vc.transpose(-1, -2)).masked_fill(upper[:n, :n], 0.0)  # [B, H, n, n]
        content = (qc @ num_prev.transpose(-1, -2) + qv @ e) * inv
        if nb > 1:
            content = content.view(b, h, n, nb, k).sum(dim=3)
        reads.append(torch.softmax((kc + gamma * content) / read_temperature, dim=-1))
        saved.append((e, inv, num_prev, nb))
        m = mu[:, :, -1]
        e0, num0 = (e, num_prev) if nb == 1 else (e[..., :k], num_prev[:, :, :k])  # band 0: c
        den = den * carry[:, :, 0] + e0.sum(dim=2)
        num = num0 + e0.transpose(-1, -2) @ vc
    r = torch.cat(reads, dim=2)

    def contract(a: torch.Tensor) -> torch.Tensor:
        outs = []
        for ac, vc, (e, inv, num_prev, nb) in zip(a.split(step, dim=2), v_chunks, saved,
                                                  strict=True):
            n = e.shape[2]
            ac = (ac.repeat(1, 1, 1, nb) if nb > 1 else ac) * inv  # [B, H, n, J K]
            intra = (ac @ e.transpose(-1, -2)).masked_fill(upper[:n, :n], 0.0)
            outs.append(ac @ num_prev + intra @ vc)
        return torch.cat(outs, dim=2)

    out, delta = read_refined(r, refine, gate, contract)
    return out, r, delta, ScanState(m=m, den=den, num=num)


def read_refined(
    r: torch.Tensor,
    refine: Refine | None,
    gate: torch.Tensor | float | None,
    contract: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The read of the chunked scans from their read weights ``r``: ``(contract(r + gate ·
    refine(r)), None)`` with a gate, else ``(contract(r), contract(refine(r)) or None)``."""
    w = refine(r).to(r.dtype) if refine is not None else None
    if w is not None and gate is not None:
        return contract(r + torch.as_tensor(gate, dtype=r.dtype, device=r.device) * w), None
    return contract(r), contract(w) if w is not None else None


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
    """One position of :func:`asa_attend_chunked` (``T = 1``, same arguments and results): the
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


def _use_triton(backend: str, like: torch.Tensor) -> bool:
    """Resolve a ``scan_backend`` value (``"auto"``, ``"torch"``, ``"triton"``)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton":
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if triton is None or not (like.is_cuda or interpreted):
            raise RuntimeError("backend 'triton' needs the triton package and a CUDA tensor "
                               "(or TRITON_INTERPRET=1 set before the kernels are imported)")
        return True
    return backend == "auto" and triton is not None and like.is_cuda


def asa_attend(
    logits: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    key_logits: torch.Tensor,
    gamma: torch.Tensor | float,
    read_temperature: float = 1.0,
    refine: Refine | None = None,
    chunk_size: int = 64,
    state: ScanState | None = None,
    backend: str = "auto",
    gate: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ScanState]:
    """Dispatcher for the scan + read (see :func:`asa_attend_chunked`).

    ``backend``: ``"torch"`` (chunk-parallel PyTorch: :func:`asa_attend_chunked`'s maths with
    hand-written backwards, ``asm_chunked_autograd.asa_attend_fused``), ``"triton"`` (the
    Triton kernels: CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton on CUDA
    when installed, else PyTorch; the interpreter is for testing kernels, so ``auto`` never
    picks it).
    """
    if _use_triton(backend, v):
        return asa_attend_triton(logits, v, q, key_logits, gamma, read_temperature, refine,
                                 state, gate)
    from .asm_chunked_autograd import asa_attend_fused

    return asa_attend_fused(logits, v, q, key_logits, gamma, read_temperature, refine,
                            chunk_size, state, gate)


def causal_linear_attention_ref(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Float64 O(T^2) causal linear attention: ``phi_q, phi_k, v [B, H, T, M]`` -> ``[B, H, T, M]``.

    A position whose normaliser ``phi_q . Z`` is 0 (nothing written yet) reads zero.
    """
    qd, kd, vd = phi_q.double(), phi_k.double(), v.double()
    t = qd.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=qd.device).tril()
    scores = (qd @ kd.transpose(-1, -2)).masked_fill(~causal, 0.0)
    return (scores @ vd) * _safe_reciprocal(scores.sum(dim=-1, keepdim=True))


def causal_linear_attention_chunked(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    chunk_size: int = 64,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Chunk-parallel causal linear attention with its recurrent state.

    ``phi_q, phi_k, v [B, H, T, M]``; ``state = (S [B, H, M, M], Z [B, H, M])``. Returns
    ``(out [B, H, T, M], (S, Z))`` after the last position.
    """
    b, h, t, mm = phi_q.shape
    dt = torch.promote_types(phi_q.dtype, torch.float32)
    phi_q, phi_k, v = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    if state is None:
        s = torch.zeros(b, h, mm, v.shape[-1], device=v.device, dtype=dt)
        z = torch.zeros(b, h, mm, device=v.device, dtype=dt)
    else:
        s, z = state[0].to(dt), state[1].to(dt)
    step = max(1, min(chunk_size, t))
    upper = torch.ones(step, step, dtype=torch.bool, device=v.device).triu(1)
    outs = []
    chunks = zip(phi_q.split(step, dim=2), phi_k.split(step, dim=2), v.split(step, dim=2),
                 strict=True)
    for qc, kc, vc in chunks:  # split: one concatenation in the backward, not a zero fill each
        n = qc.shape[2]
        scores = (qc @ kc.transpose(-1, -2)).masked_fill(upper[:n, :n], 0.0)
        numer = qc @ s + scores @ vc
        denom = (qc * z.unsqueeze(2)).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
        outs.append(numer * _safe_reciprocal(denom))
        s = s + kc.transpose(-1, -2) @ vc
        z = z + kc.sum(dim=2)
    return torch.cat(outs, dim=2), (s, z)


def causal_linear_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One position of :func:`causal_linear_attention_chunked` (``T = 1``, same arguments and
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
    # (where the reference's reciprocal overflows): the floor keeps the read finite.
    return (phi_q @ s) / (phi_q @ z.unsqueeze(-1)).clamp_min(_TINY[dt]), (s, z)


_TINY = {t: torch.finfo(t).tiny for t in (torch.float32, torch.float64)}


def causal_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    chunk_size: int = 64,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Dispatcher for the causal linear attention (``backend`` as in :func:`asa_attend`)."""
    if _use_triton(backend, v):
        return causal_linear_attention_triton(phi_q, phi_k, v, state)
    from .asm_chunked_autograd import causal_linear_attention_fused

    return causal_linear_attention_fused(phi_q, phi_k, v, chunk_size, state)


try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch forms above need no Triton
    triton = None

if triton is not None:

    @triton.jit
    def _scan_step(m, den, num, lg, vt):
        """One token of the running log-sum-exp slot scan: ``(m, den, num)`` updated with the
        token's write logits ``lg [K]`` and value ``vt [D]``."""
        c = tl.maximum(m, lg)
        c_safe = tl.where(c == float("-inf"), 0.0, c)
        carry = tl.exp(m - c_safe)
        e = tl.exp(lg - c_safe)
        return c, den * carry + e, num * carry[:, None] + e[:, None] * vt[None, :]

    @triton.jit
    def _load_scan_state(m_ptr, den_ptr, num_ptr, pid, ks, kmask, kd, kd_mask, K, D):
        """Program ``pid``'s scan state: ``m, den [K]`` and ``num [K, D]``."""
        m = tl.load(m_ptr + pid * K + ks, mask=kmask, other=float("-inf"))
        den = tl.load(den_ptr + pid * K + ks, mask=kmask, other=0.0)
        num = tl.load(num_ptr + pid * K * D + kd, mask=kd_mask, other=0.0)
        return m, den, num

    @triton.jit
    def _scan_token(logits_ptr, v_ptr, row, ks, ds, kmask, dmask, K, D, m, den, num):
        """Token ``row``'s write logits and value folded into the scan; returns the new state
        and the normalised slots ``[K, D]`` (0 where nothing was written)."""
        lg = tl.load(logits_ptr + row * K + ks, mask=kmask, other=float("-inf"))
        vt = tl.load(v_ptr + row * D + ds, mask=dmask, other=0.0)
        m, den, num = _scan_step(m, den, num, lg, vt)
        positive = den > 0
        slot = num * tl.where(positive, 1.0 / tl.where(positive, den, 1.0), 0.0)[:, None]
        return m, den, num, slot

    @triton.jit
    def slot_scan_fwd_kernel(logits_ptr, v_ptr, w_ptr, out_ptr, m_ptr, den_ptr, num_ptr, T,
                             K: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
                             BD: tl.constexpr, READ: tl.constexpr):
        """One program per (batch, head): the write scan over time, states in registers.

        ``READ``: ``out_t = sum_s w[t, s] slot_s(t)`` (``w [T, K]``, ``out [T, D]``); else
        ``out[t, s] = <w_t, slot_s(t)>`` (``w [T, D]``, ``out [T, K]``). Stores nothing per
        position beyond ``out`` (the backward recomputes the scan); reads the initial and writes
        the final state (``m, den [K]``, ``num [K, D]``).
        """
        pid = tl.program_id(0)
        ks = tl.arange(0, BK)
        ds = tl.arange(0, BD)
        kmask = ks < K
        dmask = ds < D
        kd_mask = kmask[:, None] & dmask[None, :]
        kd = ks[:, None] * D + ds[None, :]
        m, den, num = _load_scan_state(m_ptr, den_ptr, num_ptr, pid, ks, kmask, kd, kd_mask,
                                       K, D)
        for t in range(T):
            m, den, num, slot = _scan_token(
                logits_ptr, v_ptr, pid * T + t, ks, ds, kmask, dmask, K, D, m, den, num)
            if READ:
                wt = tl.load(w_ptr + (pid * T + t) * K + ks, mask=kmask, other=0.0)
                tl.store(out_ptr + (pid * T + t) * D + ds, tl.sum(wt[:, None] * slot, axis=0),
                         mask=dmask)
            else:
                xt = tl.load(w_ptr + (pid * T + t) * D + ds, mask=dmask, other=0.0)
                tl.store(out_ptr + (pid * T + t) * K + ks, tl.sum(slot * xt[None, :], axis=1),
                         mask=kmask)
        tl.store(m_ptr + pid * K + ks, m, mask=kmask)
        tl.store(den_ptr + pid * K + ks, den, mask=kmask)
        tl.store(num_ptr + pid * K * D + kd, num, mask=kd_mask)

    @triton.jit
    def slot_scan_bwd_kernel(logits_ptr, v_ptr, a_ptr, x_ptr, m_ptr, den_ptr, num_ptr,
                             mt_ptr, dent_ptr, p_ptr, y_ptr, dlogits_ptr, dv_ptr, T,
                             K: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
                             BD: tl.constexpr):
        """Backward of the scan for upstream slot gradients ``G_s(t) = a[t, s] x_t``.

        Forward pass in time (the scan recomputed): ``p[t, s] = <x_t, slot_s(t)>``,
        ``y_t = sum_s a[t, s] slot_s(t)``, and per position the running max ``m_t`` and the
        scaled denominator ``den_t`` (``D_s(t) = den_t e^(m_t)``, ``den_t >= 1`` once written)
        into the scratch ``mt, dent [T, K]``. Reverse pass with the rescaled accumulators,
        whose factors ``D(t) / D(t+1) = (den_t / den_{t+1}) e^(m_t - m_{t+1}) <= 1`` and
        ``e^(l - m_t) / den_t <= 1`` only ever subtract logits (never a large absolute
        log-sum-exp, whose float32 rounding would grow with the logits):
        ``R_s(t) = G_s(t) + D(t) / D(t+1) R_s(t+1)``,
        ``U_s(t) = a[t, s] p[t, s] + D(t) / D(t+1) U_s(t+1)``:
        ``dv_t = sum_s P[t, s] R_s(t)``, ``dl[t, s] = P[t, s] (<v_t, R_s(t)> - U_s(t))`` with
        ``P[t, s] = e^(l[t, s] - m_t) / den_t``.
        The initial state (``m, den [K]``, ``num [K, D]``) is a constant.
        """
        pid = tl.program_id(0)
        ks = tl.arange(0, BK)
        ds = tl.arange(0, BD)
        kmask = ks < K
        dmask = ds < D
        kd_mask = kmask[:, None] & dmask[None, :]
        kd = ks[:, None] * D + ds[None, :]
        m, den, num = _load_scan_state(m_ptr, den_ptr, num_ptr, pid, ks, kmask, kd, kd_mask,
                                       K, D)
        for t in range(T):
            m, den, num, slot = _scan_token(
                logits_ptr, v_ptr, pid * T + t, ks, ds, kmask, dmask, K, D, m, den, num)
            tl.store(mt_ptr + (pid * T + t) * K + ks, m, mask=kmask)
            tl.store(dent_ptr + (pid * T + t) * K + ks, den, mask=kmask)
            xt = tl.load(x_ptr + (pid * T + t) * D + ds, mask=dmask, other=0.0)
            at = tl.load(a_ptr + (pid * T + t) * K + ks, mask=kmask, other=0.0)
            tl.store(p_ptr + (pid * T + t) * K + ks, tl.sum(slot * xt[None, :], axis=1),
                     mask=kmask)
            tl.store(y_ptr + (pid * T + t) * D + ds, tl.sum(at[:, None] * slot, axis=0),
                     mask=dmask)
        r_acc = tl.zeros((BK, BD), dtype=tl.float32)
        u_acc = tl.zeros((BK,), dtype=tl.float32)
        m_next = tl.full((BK,), float("-inf"), dtype=tl.float32)
        den_next = tl.zeros((BK,), dtype=tl.float32)
        for i in range(T):
            t = T - 1 - i
            mt = tl.load(mt_ptr + (pid * T + t) * K + ks, mask=kmask, other=float("-inf"))
            dent = tl.load(dent_ptr + (pid * T + t) * K + ks, mask=kmask, other=0.0)
            finite = (mt != float("-inf")) & (m_next != float("-inf"))
            gap = tl.where(finite, mt, 0.0) - tl.where(finite, m_next, 0.0)
            decay = tl.where(finite, tl.exp(gap) * dent / tl.where(finite, den_next, 1.0), 0.0)
            xt = tl.load(x_ptr + (pid * T + t) * D + ds, mask=dmask, other=0.0)
            at = tl.load(a_ptr + (pid * T + t) * K + ks, mask=kmask, other=0.0)
            pt = tl.load(p_ptr + (pid * T + t) * K + ks, mask=kmask, other=0.0)
            r_acc = at[:, None] * xt[None, :] + decay[:, None] * r_acc
            u_acc = at * pt + decay * u_acc
            lg = tl.load(logits_ptr + (pid * T + t) * K + ks, mask=kmask, other=float("-inf"))
            vt = tl.load(v_ptr + (pid * T + t) * D + ds, mask=dmask, other=0.0)
            written = lg != float("-inf")  # then m_t is finite and den_t >= 1
            gap = tl.where(written, lg, 0.0) - tl.where(written, mt, 0.0)
            prob = tl.where(written, tl.exp(gap) / tl.where(written, dent, 1.0), 0.0)
            tl.store(dv_ptr + (pid * T + t) * D + ds, tl.sum(prob[:, None] * r_acc, axis=0),
                     mask=dmask)
            dl = prob * (tl.sum(r_acc * vt[None, :], axis=1) - u_acc)
            tl.store(dlogits_ptr + (pid * T + t) * K + ks, dl, mask=kmask)
            m_next = mt
            den_next = dent

    @triton.jit
    def linear_attn_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, z_ptr, s_ptr, zs_ptr, T,
                               M: tl.constexpr, BM: tl.constexpr):
        """One program per (batch, head): ``S [M, M]``, ``Z [M]`` in registers;
        ``out_t = q_t S_t / (q_t . Z_t)``, storing the normaliser ``z [T]``; reads the initial
        and writes the final ``(S, Z)``."""
        pid = tl.program_id(0)
        ms = tl.arange(0, BM)
        mmask = ms < M
        mm_mask = mmask[:, None] & mmask[None, :]
        mm = ms[:, None] * M + ms[None, :]
        s = tl.load(s_ptr + pid * M * M + mm, mask=mm_mask, other=0.0)
        z = tl.load(zs_ptr + pid * M + ms, mask=mmask, other=0.0)
        for t in range(T):
            row = (pid * T + t) * M + ms
            qt = tl.load(q_ptr + row, mask=mmask, other=0.0)
            kt = tl.load(k_ptr + row, mask=mmask, other=0.0)
            vt = tl.load(v_ptr + row, mask=mmask, other=0.0)
            s += kt[:, None] * vt[None, :]
            z += kt
            norm = tl.sum(qt * z, axis=0)
            inv = tl.where(norm > 0, 1.0 / tl.where(norm > 0, norm, 1.0), 0.0)
            tl.store(out_ptr + row, tl.sum(qt[:, None] * s, axis=0) * inv, mask=mmask)
            tl.store(z_ptr + pid * T + t, norm)
        tl.store(s_ptr + pid * M * M + mm, s, mask=mm_mask)
        tl.store(zs_ptr + pid * M + ms, z, mask=mmask)

    @triton.jit
    def linear_attn_bwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, z_ptr, g_ptr, s_ptr, zs_ptr,
                               dq_ptr, dk_ptr, dv_ptr, T, M: tl.constexpr, BM: tl.constexpr):
        """Backward of :func:`linear_attn_fwd_kernel` (the initial state is a constant).

        With ``gn_t = g_t / z_t`` and ``gz_t = -<g_t, out_t> / z_t`` (0 where ``z_t = 0``):
        ``dq_t = S_t gn_t + gz_t Z_t`` (forward in time), then backwards
        ``dS = sum_{t>=tau} q_t gn_t^T``, ``dZ = sum_{t>=tau} gz_t q_t``,
        ``dk_tau = dS v_tau + dZ``, ``dv_tau = dS^T k_tau``.
        """
        pid = tl.program_id(0)
        ms = tl.arange(0, BM)
        mmask = ms < M
        mm_mask = mmask[:, None] & mmask[None, :]
        s = tl.load(s_ptr + pid * M * M + ms[:, None] * M + ms[None, :], mask=mm_mask,
                    other=0.0)
        z = tl.load(zs_ptr + pid * M + ms, mask=mmask, other=0.0)
        for t in range(T):
            row = (pid * T + t) * M + ms
            kt = tl.load(k_ptr + row, mask=mmask, other=0.0)
            vt = tl.load(v_ptr + row, mask=mmask, other=0.0)
            s += kt[:, None] * vt[None, :]
            z += kt
            norm = tl.load(z_ptr + pid * T + t)
            inv = tl.where(norm > 0, 1.0 / tl.where(norm > 0, norm, 1.0), 0.0)
            gt = tl.load(g_ptr + row, mask=mmask, other=0.0)
            ot = tl.load(out_ptr + row, mask=mmask, other=0.0)
            gz = -tl.sum(gt * ot, axis=0) * inv
            tl.store(dq_ptr + row, tl.sum(s * (gt * inv)[None, :], axis=1) + gz * z,
                     mask=mmask)
        ds = tl.zeros((BM, BM), dtype=tl.float32)
        dz = tl.zeros((BM,), dtype=tl.float32)
        for i in range(T):
            t = T - 1 - i
            row = (pid * T + t) * M + ms
            qt = tl.load(q_ptr + row, mask=mmask, other=0.0)
            kt = tl.load(k_ptr + row, mask=mmask, other=0.0)
            vt = tl.load(v_ptr + row, mask=mmask, other=0.0)
            norm = tl.load(z_ptr + pid * T + t)
            inv = tl.where(norm > 0, 1.0 / tl.where(norm > 0, norm, 1.0), 0.0)
            gt = tl.load(g_ptr + row, mask=mmask, other=0.0)
            ot = tl.load(out_ptr + row, mask=mmask, other=0.0)
            gz = -tl.sum(gt * ot, axis=0) * inv
            ds += qt[:, None] * (gt * inv)[None, :]
            dz += gz * qt
            tl.store(dk_ptr + row, tl.sum(ds * vt[None, :], axis=1) + dz, mask=mmask)
            tl.store(dv_ptr + row, tl.sum(ds * kt[:, None], axis=0), mask=mmask)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).contiguous()


def _scan_launch(read: bool, w: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                 state: ScanState) -> tuple[torch.Tensor, ScanState]:
    b, h, t, k = logits.shape
    d = v.shape[-1]
    out = torch.empty((b, h, t, d if read else k), device=v.device, dtype=torch.float32)
    m, den, num = (_flat(x).clone() for x in (state.m, state.den, state.num))
    slot_scan_fwd_kernel[(b * h,)](
        _flat(logits), _flat(v), _flat(w), out, m, den, num, t, K=k, D=d,
        BK=triton.next_power_of_2(k), BD=triton.next_power_of_2(d), READ=read)
    return out, ScanState(m=m, den=den, num=num)


def _scan_backward(a: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                   state: ScanState) -> tuple[torch.Tensor, ...]:
    b, h, t, k = logits.shape
    d = v.shape[-1]
    p = torch.empty((b, h, t, k), device=v.device, dtype=torch.float32)
    mt, dent = torch.empty_like(p), torch.empty_like(p)
    y = torch.empty((b, h, t, d), device=v.device, dtype=torch.float32)
    dlogits = torch.empty_like(p)
    dv = torch.empty_like(y)
    slot_scan_bwd_kernel[(b * h,)](
        _flat(logits), _flat(v), _flat(a), _flat(x), _flat(state.m), _flat(state.den),
        _flat(state.num), mt, dent, p, y, dlogits, dv, t, K=k, D=d, BK=triton.next_power_of_2(k),
        BD=triton.next_power_of_2(d))
    return p, y, dlogits, dv


class _SlotRead(torch.autograd.Function):
    """``out_t = sum_s a[t, s] slot_s(t)`` on the Triton kernels; the initial state is constant."""

    @staticmethod
    def forward(ctx, a, logits, v, m, den, num):
        state = ScanState(m=m, den=den, num=num)
        out, final = _scan_launch(True, a, logits, v, state)
        ctx.save_for_backward(a, logits, v, m, den, num)
        ctx.mark_non_differentiable(final.m, final.den, final.num)
        return out, final.m, final.den, final.num

    @staticmethod
    def backward(ctx, grad_out, *unused):
        a, logits, v, m, den, num = ctx.saved_tensors
        p, _, dlogits, dv = _scan_backward(a, grad_out, logits, v, ScanState(m, den, num))
        return p, dlogits, dv, None, None, None


class _SlotScores(torch.autograd.Function):
    """``out[t, s] = <x_t, slot_s(t)>`` on the Triton kernels; the initial state is constant."""

    @staticmethod
    def forward(ctx, x, logits, v, m, den, num):
        out, _ = _scan_launch(False, x, logits, v, ScanState(m=m, den=den, num=num))
        ctx.save_for_backward(x, logits, v, m, den, num)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, logits, v, m, den, num = ctx.saved_tensors
        _, y, dlogits, dv = _scan_backward(grad_out, x, logits, v, ScanState(m, den, num))
        return y, dlogits, dv, None, None, None


def slot_read_triton(a: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                     state: ScanState | None = None) -> tuple[torch.Tensor, ScanState]:
    """``sum_s a[t, s] slot_s(t)`` ``[B, H, T, d]`` and the final state, on Triton (float32).

    ``a, logits [B, H, T, K]``, ``v [B, H, T, d]``. Saves only the inputs for the backward
    pass, which recomputes the scan in registers (with ``[B, H, T, K]`` scratch for the running
    max and denominator per position).
    """
    if triton is None:
        raise RuntimeError("slot_read_triton needs the triton package")
    b, h, _, k = logits.shape
    if state is None:
        state = ScanState.empty(b, h, k, v.shape[-1], v.device, torch.float32)
    out, m, den, num = _SlotRead.apply(a, logits, v, state.m, state.den, state.num)
    return out, ScanState(m=m, den=den, num=num)


def slot_scores_triton(x: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                       state: ScanState | None = None) -> torch.Tensor:
    """``<x_t, slot_s(t)>`` ``[B, H, T, K]`` on Triton (float32); ``x [B, H, T, d]``."""
    if triton is None:
        raise RuntimeError("slot_scores_triton needs the triton package")
    b, h, _, k = logits.shape
    if state is None:
        state = ScanState.empty(b, h, k, v.shape[-1], v.device, torch.float32)
    return _SlotScores.apply(x, logits, v, state.m, state.den, state.num)


def slot_read_ref(a: torch.Tensor, logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 reference of :func:`slot_read_triton`: ``[B, H, T, d]``."""
    return torch.einsum("bhtk,bhtkd->bhtd", a.double(), slot_states_ref(logits, v))


def slot_scores_ref(x: torch.Tensor, logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 reference of :func:`slot_scores_triton`: ``[B, H, T, K]``."""
    return torch.einsum("bhtd,bhtkd->bhtk", x.double(), slot_states_ref(logits, v))


class _LinearAttention(torch.autograd.Function):
    """Causal linear attention on the Triton kernels; the initial state is constant."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, s0, z0):
        b, h, t, mm = phi_q.shape
        out = torch.empty((b, h, t, mm), device=v.device, dtype=torch.float32)
        norm = torch.empty((b, h, t), device=v.device, dtype=torch.float32)
        s, z = _flat(s0).clone(), _flat(z0).clone()
        linear_attn_fwd_kernel[(b * h,)](_flat(phi_q), _flat(phi_k), _flat(v), out, norm, s, z,
                                         t, M=mm, BM=triton.next_power_of_2(mm))
        ctx.save_for_backward(phi_q, phi_k, v, out, norm, s0, z0)
        ctx.mark_non_differentiable(s, z)
        return out, s, z

    @staticmethod
    def backward(ctx, grad_out, *unused):
        phi_q, phi_k, v, out, norm, s0, z0 = ctx.saved_tensors
        b, h, t, mm = phi_q.shape
        dq, dk, dv = (torch.empty((b, h, t, mm), device=v.device, dtype=torch.float32)
                      for _ in range(3))
        linear_attn_bwd_kernel[(b * h,)](
            _flat(phi_q), _flat(phi_k), _flat(v), out, norm, _flat(grad_out), _flat(s0),
            _flat(z0), dq, dk, dv, t, M=mm, BM=triton.next_power_of_2(mm))
        return dq, dk, dv, None, None


def causal_linear_attention_triton(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`causal_linear_attention_chunked` on Triton (float32, square ``M x M`` state).

    Saves only the normalisers ``[B, H, T]`` and the output beside the inputs.
    """
    if triton is None:
        raise RuntimeError("causal_linear_attention_triton needs the triton package")
    b, h, _, mm = phi_q.shape
    if v.shape[-1] != mm:
        raise ValueError(f"the Triton kernel needs v of width {mm}, got {v.shape[-1]}")
    if state is None:
        state = (torch.zeros(b, h, mm, mm, device=v.device),
                 torch.zeros(b, h, mm, device=v.device))
    out, s, z = _LinearAttention.apply(phi_q, phi_k, v, state[0], state[1])
    return out, (s, z)


def asa_attend_triton(
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
    """:func:`asa_attend_chunked` on the Triton scan kernels (same arguments and results).

    The content scores and the read are two launches of the recurrent kernel; the second
    recomputes the slot states in registers instead of storing ``[T, K, d]``.
    """
    gamma = torch.as_tensor(gamma, dtype=torch.float32, device=v.device)
    gamma = gamma.view(1, -1, 1, 1) if gamma.dim() == 1 else gamma
    content = slot_scores_triton(q, logits, v, state)
    r = torch.softmax((key_logits.float() + gamma * content) / read_temperature, dim=-1)
    w = refine(r).float() if refine is not None else None
    if w is not None and gate is not None:
        o, final = slot_read_triton(r + torch.as_tensor(gate, dtype=torch.float32) * w, logits,
                                    v, state)
        return o, r, None, final
    o, final = slot_read_triton(r, logits, v, state)
    delta = slot_read_triton(w, logits, v, state)[0] if w is not None else None
    return o, r, delta, final
