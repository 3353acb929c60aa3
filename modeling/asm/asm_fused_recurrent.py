"""The fused recurrent form of the ASM kernels: sequential Triton scans, one program per (batch,
head), forward and backward (fla's ``fused_recurrent``).

``slot_scan_fwd_kernel`` / ``slot_scan_bwd_kernel`` compute the scan + read
(:func:`slot_read_fused_recurrent`, :func:`slot_scores_fused_recurrent`,
:func:`asa_attend_fused_recurrent`); ``linear_attn_fwd_kernel`` / ``linear_attn_bwd_kernel`` the
slot-space linear attention (:func:`causal_linear_attention_fused_recurrent`). Without the triton
package the wrappers raise; the other forms need no Triton.
"""

from __future__ import annotations

import torch

from .asm_common import Refine, ScanState, attend_through

__all__ = ["asa_attend_fused_recurrent", "causal_linear_attention_fused_recurrent",
           "slot_read_fused_recurrent", "slot_scores_fused_recurrent"]

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


def slot_read_fused_recurrent(a: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                     state: ScanState | None = None) -> tuple[torch.Tensor, ScanState]:
    """``sum_s a[t, s] slot_s(t)`` ``[B, H, T, d]`` and the final state, on Triton (float32).

    ``a, logits [B, H, T, K]``, ``v [B, H, T, d]``. Saves only the inputs for the backward
    pass, which recomputes the scan in registers (with ``[B, H, T, K]`` scratch for the running
    max and denominator per position).
    """
    if triton is None:
        raise RuntimeError("slot_read_fused_recurrent needs the triton package")
    b, h, _, k = logits.shape
    if state is None:
        state = ScanState.empty(b, h, k, v.shape[-1], v.device, torch.float32)
    out, m, den, num = _SlotRead.apply(a, logits, v, state.m, state.den, state.num)
    return out, ScanState(m=m, den=den, num=num)


def slot_scores_fused_recurrent(x: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                       state: ScanState | None = None) -> torch.Tensor:
    """``<x_t, slot_s(t)>`` ``[B, H, T, K]`` on Triton (float32); ``x [B, H, T, d]``."""
    if triton is None:
        raise RuntimeError("slot_scores_fused_recurrent needs the triton package")
    b, h, _, k = logits.shape
    if state is None:
        state = ScanState.empty(b, h, k, v.shape[-1], v.device, torch.float32)
    return _SlotScores.apply(x, logits, v, state.m, state.den, state.num)


class _RecurrentLinearAttention(torch.autograd.Function):
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


def causal_linear_attention_fused_recurrent(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`causal_linear_attention_chunk_autograd` on Triton (float32, square ``M x M`` state).

    Saves only the normalisers ``[B, H, T]`` and the output beside the inputs.
    """
    if triton is None:
        raise RuntimeError("causal_linear_attention_fused_recurrent needs the triton package")
    b, h, _, mm = phi_q.shape
    if v.shape[-1] != mm:
        raise ValueError(f"the Triton kernel needs v of width {mm}, got {v.shape[-1]}")
    if state is None:
        state = (torch.zeros(b, h, mm, mm, device=v.device),
                 torch.zeros(b, h, mm, device=v.device))
    out, s, z = _RecurrentLinearAttention.apply(phi_q, phi_k, v, state[0], state[1])
    return out, (s, z)


def asa_attend_fused_recurrent(
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
    """:func:`asa_attend_chunk_autograd` on the Triton scan kernels (same arguments and results).

    The content scores and the read are two launches of the recurrent kernel; the second
    recomputes the slot states in registers instead of storing ``[T, K, d]``.
    """
    return attend_through(slot_scores_fused_recurrent, slot_read_fused_recurrent, logits, v, q,
                          key_logits, gamma, read_temperature, refine, state, gate)
