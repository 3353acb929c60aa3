"""The chunk-parallel Triton form of the ASM kernels (fla's ``chunk``): forward and backward.

Three launches per pass, as flash-linear-attention splits its chunk kernels: every chunk's own
summary in parallel (:func:`chunk_local_kernel`), a short recurrence over the chunk summaries per
(batch, head) (:func:`chunk_prefix_kernel`: ``T / C`` steps of ``[K, d]`` updates), then every
chunk's outputs in parallel from its start state (:func:`chunk_out_kernel`). The programs number
``B H T / C`` where the fused recurrent form runs ``B H`` sequential ones.

Exact however steep the write logits, with no bands: each position is weighed against its own
running max ``mu_s(t) = max(m_s, max_{tau<=t} l_{s,tau})`` (one ``cummax`` before the launch).
Inside a chunk, slot by slot, ``E_s[t, tau] = exp(l[tau, s] - mu_s(t))`` (``tau <= t``) is a
``[C, C]`` tile of numbers in ``[0, 1]``; the chunk's start state is carried relative to the
running max at the chunk boundary ``b_c``, and ``exp(b_c - mu_s(t)) <= 1``. So nothing
overflows, and every denominator is ``>= 1`` once a slot is written. The read weights then
form one ``[C, C]`` matrix ``W[t, tau] = sum_s a[t, s] E_s[t, tau] / den_s(t)`` and the read is
two matrix products, ``W V`` and the carried part ``(a / den * exp(b_c - mu)) num_c``.

The backward pass (upstream slot gradients ``G_s(t) = a[t, s] x_t``, as in
:mod:`.asm_fused_recurrent`) runs the same three launches in reverse: chunk summaries
``sum_t a[t, s] exp(b_c - mu_s(t)) / den_s(t) (x_t, p[t, s])`` relative to the chunk's start
reference, the recurrence from the last chunk backwards (factors ``exp(b_c - b_{c+1}) <= 1``),
then ``dv`` and ``dlogits`` per chunk: inside the chunk through the same ``W`` and ``E_s``
tiles, from later chunks through ``exp(l - b_{c+1})`` and the carried ``(R, U)``.

The slot-space linear attention has the same three launches without the running max.
Products run in float32 (``input_precision="ieee"``: TF32 would cost the float32 tolerance of
the tests). Without the triton package the wrappers raise; the other forms need no Triton.
"""

from __future__ import annotations

from functools import partial

import torch

from .asm_common import Refine, ScanState, attend_through
from .asm_fused_recurrent import triton

__all__ = ["asa_attend_triton_chunk", "causal_linear_attention_triton_chunk",
           "slot_read_triton_chunk", "slot_scores_triton_chunk"]

CHUNK = 32  # positions per chunk: the H200's best at batch 1, within 1.2x of 16 at batch 16

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dot(a, b):
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def chunk_prefix_kernel(loc_ptr, ref_ptr, init_ptr, out_ptr, final_ptr, NT,
                            K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                            BW: tl.constexpr, REVERSE: tl.constexpr):
        """The recurrence over chunk summaries, one program per (batch, head).

        ``loc [NT, K, W]``: each chunk's summary; ``ref [NT + 1, K]``: the references at the
        chunk boundaries. Forward: ``out_c`` is the state before chunk ``c`` (relative to
        ``ref_c``), then ``acc = exp(ref_c - ref_{c+1}) acc + loc_c``; starts at ``init`` and
        writes the last ``acc`` to ``final``. ``REVERSE``: the same from the last chunk down,
        starting at zero: ``out_c`` is everything after chunk ``c`` relative to ``ref_{c+1}``.
        """
        pid = tl.program_id(0)
        ks = tl.arange(0, BK)
        ws = tl.arange(0, BW)
        kmask = ks < K
        kw_mask = kmask[:, None] & (ws < W)[None, :]
        kw = ks[:, None] * W + ws[None, :]
        if REVERSE:
            acc = tl.zeros((BK, BW), dtype=tl.float32)
        else:
            acc = tl.load(init_ptr + pid * K * W + kw, mask=kw_mask, other=0.0)
        for i in range(NT):
            c = i
            if REVERSE:
                c = NT - 1 - i
            tl.store(out_ptr + (pid * NT + c) * K * W + kw, acc, mask=kw_mask)
            before = tl.load(ref_ptr + (pid * (NT + 1) + c) * K + ks, mask=kmask,
                             other=float("-inf"))
            after = tl.load(ref_ptr + (pid * (NT + 1) + c + 1) * K + ks, mask=kmask,
                            other=float("-inf"))
            decay = tl.where(after > float("-inf"),
                             tl.exp(before - tl.where(after > float("-inf"), after, 0.0)), 0.0)
            loc = tl.load(loc_ptr + (pid * NT + c) * K * W + kw, mask=kw_mask, other=0.0)
            acc = decay[:, None] * acc + loc
        if not REVERSE:
            tl.store(final_ptr + pid * K * W + kw, acc, mask=kw_mask)

    @triton.jit
    def _slot_tile(l_ptr, mu_ptr, ref_ptr, start_ptr, base, ref_row, start, s, ts, tmask,
                   K: tl.constexpr, D: tl.constexpr):
        """Slot ``s`` of one chunk: ``E[t, tau] = exp(l[tau, s] - mu_s(t))`` for ``tau <= t``
        (0 elsewhere, and where nothing is written), the carry factor ``exp(b_c - mu_s(t))``
        and ``1 / den_s(t)``, ``den_s(t) = den_c,s carry + sum_tau E[t, tau]`` (0 unwritten)."""
        lg = tl.load(l_ptr + base + ts * K + s, mask=tmask, other=float("-inf"))
        mu = tl.load(mu_ptr + base + ts * K + s, mask=tmask, other=float("-inf"))
        keep = ((ts[None, :] <= ts[:, None]) & (lg[None, :] > float("-inf"))
                & (mu[:, None] > float("-inf")))
        gap = tl.where(keep, lg[None, :], 0.0) - tl.where(keep, mu[:, None], 0.0)
        e = tl.where(keep, tl.exp(gap), 0.0)
        carry = _carry(tl.load(ref_ptr + ref_row + s), mu)
        den0 = tl.load(start_ptr + start + s * (D + 1) + D)
        return e, carry, _inverse(den0 * carry + tl.sum(e, axis=1))

    @triton.jit
    def _carry(start_ref, mu):
        """``exp(b_c - mu_s(t)) <= 1`` (0 before the slot's first write)."""
        written = mu > float("-inf")
        gap = tl.where(written, start_ref, 0.0) - tl.where(written, mu, 0.0)
        return tl.where(written, tl.exp(gap), 0.0)

    @triton.jit
    def _inverse(den):
        return tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)

    @triton.jit
    def chunk_local_kernel(l_ptr, ref_ptr, v_ptr, loc_ptr, T, NT, K: tl.constexpr,
                           D: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                           BD: tl.constexpr):
        """Chunk ``c``'s own write summary relative to its end reference ``b_{c+1}``:
        ``num = E^T V [K, d]`` and ``den = sum_tau E [K]`` with ``E = exp(l - b_{c+1})``,
        stored as ``loc [K, d + 1]``. Grid ``(NT, B H)``."""
        c = tl.program_id(0)
        bh = tl.program_id(1)
        ts = c * C + tl.arange(0, C)
        ks = tl.arange(0, BK)
        ds = tl.arange(0, BD)
        tmask = ts < T
        kmask = ks < K
        lg = tl.load(l_ptr + bh * T * K + ts[:, None] * K + ks[None, :],
                     mask=tmask[:, None] & kmask[None, :], other=float("-inf"))
        end = tl.load(ref_ptr + (bh * (NT + 1) + c + 1) * K + ks, mask=kmask,
                      other=float("-inf"))
        keep = (lg > float("-inf")) & (end[None, :] > float("-inf"))
        e = tl.where(keep, tl.exp(tl.where(keep, lg, 0.0) - tl.where(keep, end[None, :], 0.0)),
                     0.0)
        vt = tl.load(v_ptr + bh * T * D + ts[:, None] * D + ds[None, :],
                     mask=tmask[:, None] & (ds < D)[None, :], other=0.0)
        base = (bh * NT + c) * K * (D + 1)
        tl.store(loc_ptr + base + ks[:, None] * (D + 1) + ds[None, :], _dot(tl.trans(e), vt),
                 mask=kmask[:, None] & (ds < D)[None, :])
        tl.store(loc_ptr + base + ks * (D + 1) + D, tl.sum(e, axis=0), mask=kmask)

    @triton.jit
    def chunk_out_kernel(l_ptr, mu_ptr, ref_ptr, v_ptr, w_ptr, start_ptr, out_ptr, p_ptr,
                         back_ptr, T, NT, K: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
                         BK: tl.constexpr, BD: tl.constexpr, READ: tl.constexpr,
                         BACKWARD: tl.constexpr):
        """One chunk's outputs from its start state ``start [K, d + 1]`` (relative to ``b_c``).

        ``READ``: ``out_t = sum_s w[t, s] slot_s(t)`` (``w [T, K]``, ``out [T, d]``); else
        ``out[t, s] = <w_t, slot_s(t)>`` (``w [T, d]``, ``out [T, K]``). ``BACKWARD`` (with
        ``READ``; ``out_ptr`` then holds ``x [T, d]`` and ``p_ptr`` ``p [T, K]``): instead of
        the read, the chunk's backward summary ``sum_t B[t, s] (x_t, p[t, s])`` with
        ``B = w exp(b_c - mu) / den``, into ``back [K, d + 1]`` (relative to ``b_c``).
        Grid ``(NT, B H)``.
        """
        c = tl.program_id(0)
        bh = tl.program_id(1)
        offs = tl.arange(0, C)
        ts = c * C + offs
        ks = tl.arange(0, BK)
        ds = tl.arange(0, BD)
        tmask = ts < T
        kmask = ks < K
        dmask = ds < D
        td_mask = tmask[:, None] & dmask[None, :]
        tk_mask = tmask[:, None] & kmask[None, :]
        base_k = bh * T * K + c * C * K
        start = (bh * NT + c) * K * (D + 1)
        num0 = tl.load(start_ptr + start + ks[:, None] * (D + 1) + ds[None, :],
                       mask=kmask[:, None] & dmask[None, :], other=0.0)
        vt = tl.load(v_ptr + bh * T * D + ts[:, None] * D + ds[None, :], mask=td_mask,
                     other=0.0)
        if READ:
            wt = tl.zeros((C, C), dtype=tl.float32)
            carried = tl.zeros((C, BK), dtype=tl.float32)
        else:
            xt = tl.load(w_ptr + bh * T * D + ts[:, None] * D + ds[None, :], mask=td_mask,
                         other=0.0)
            xv = _dot(xt, tl.trans(vt))  # [t, tau]
            xn = _dot(xt, tl.trans(num0))  # [t, s]
            out = tl.zeros((C, BK), dtype=tl.float32)
        for s in range(K):
            e, carry, inv = _slot_tile(l_ptr, mu_ptr, ref_ptr, start_ptr, base_k,
                                       (bh * (NT + 1) + c) * K, start, s, offs, tmask, K, D)
            if READ:
                a = tl.load(w_ptr + base_k + offs * K + s, mask=tmask, other=0.0) * inv
                wt += a[:, None] * e
                carried = tl.where(ks[None, :] == s, (a * carry)[:, None], carried)
            else:
                own = tl.sum(tl.where(ks[None, :] == s, xn, 0.0), axis=1)
                col = (carry * own + tl.sum(e * xv, axis=1)) * inv
                out = tl.where(ks[None, :] == s, col[:, None], out)
        if BACKWARD:
            xt = tl.load(out_ptr + bh * T * D + ts[:, None] * D + ds[None, :], mask=td_mask,
                         other=0.0)
            pt = tl.load(p_ptr + base_k + offs[:, None] * K + ks[None, :], mask=tk_mask,
                         other=0.0)
            tl.store(back_ptr + start + ks[:, None] * (D + 1) + ds[None, :],
                     _dot(tl.trans(carried), xt), mask=kmask[:, None] & dmask[None, :])
            tl.store(back_ptr + start + ks * (D + 1) + D, tl.sum(carried * pt, axis=0),
                     mask=kmask)
        elif READ:
            tl.store(out_ptr + bh * T * D + ts[:, None] * D + ds[None, :],
                     _dot(carried, num0) + _dot(wt, vt), mask=td_mask)
        else:
            tl.store(out_ptr + base_k + offs[:, None] * K + ks[None, :], out, mask=tk_mask)

    @triton.jit
    def chunk_grad_kernel(l_ptr, mu_ptr, ref_ptr, v_ptr, a_ptr, x_ptr, p_ptr, start_ptr,
                          after_ptr, dl_ptr, dv_ptr, T, NT, K: tl.constexpr, D: tl.constexpr,
                          C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
        """``dv`` and ``dlogits`` of one chunk for ``G_s(t) = a[t, s] x_t``, with
        ``p[t, s] = <x_t, slot_s(t)>``: inside the chunk
        ``dv_tau = sum_t W[t, tau] x_t`` and
        ``dl[tau, s] = sum_t a[t, s] E_s[t, tau] / den_s(t) (<x_t, v_tau> - p[t, s])``; from
        later chunks, with ``(R, U) = after [K, d + 1]`` relative to ``b_{c+1}`` and
        ``F = exp(l - b_{c+1})``: ``dv += F R``, ``dl += F (V R^T - U)``. Grid ``(NT, B H)``."""
        c = tl.program_id(0)
        bh = tl.program_id(1)
        offs = tl.arange(0, C)
        ts = c * C + offs
        ks = tl.arange(0, BK)
        ds = tl.arange(0, BD)
        tmask = ts < T
        kmask = ks < K
        dmask = ds < D
        td_mask = tmask[:, None] & dmask[None, :]
        tk_mask = tmask[:, None] & kmask[None, :]
        kd_mask = kmask[:, None] & dmask[None, :]
        base_k = bh * T * K + c * C * K
        start = (bh * NT + c) * K * (D + 1)
        vt = tl.load(v_ptr + bh * T * D + ts[:, None] * D + ds[None, :], mask=td_mask,
                     other=0.0)
        xt = tl.load(x_ptr + bh * T * D + ts[:, None] * D + ds[None, :], mask=td_mask,
                     other=0.0)
        xv = _dot(xt, tl.trans(vt))  # [t, tau]
        wt = tl.zeros((C, C), dtype=tl.float32)
        dl = tl.zeros((C, BK), dtype=tl.float32)
        for s in range(K):
            e, _, inv = _slot_tile(l_ptr, mu_ptr, ref_ptr, start_ptr, base_k,
                                   (bh * (NT + 1) + c) * K, start, s, offs, tmask, K, D)
            a = tl.load(a_ptr + base_k + offs * K + s, mask=tmask, other=0.0) * inv
            p = tl.load(p_ptr + base_k + offs * K + s, mask=tmask, other=0.0)
            ae = a[:, None] * e
            wt += ae
            col = tl.sum(ae * (xv - p[:, None]), axis=0)  # over t: one value per tau
            dl = tl.where(ks[None, :] == s, col[:, None], dl)
        lg = tl.load(l_ptr + base_k + offs[:, None] * K + ks[None, :], mask=tk_mask,
                     other=float("-inf"))
        end = tl.load(ref_ptr + (bh * (NT + 1) + c + 1) * K + ks, mask=kmask,
                      other=float("-inf"))
        keep = (lg > float("-inf")) & (end[None, :] > float("-inf"))
        f = tl.where(keep, tl.exp(tl.where(keep, lg, 0.0) - tl.where(keep, end[None, :], 0.0)),
                     0.0)
        r = tl.load(after_ptr + start + ks[:, None] * (D + 1) + ds[None, :], mask=kd_mask,
                    other=0.0)
        u = tl.load(after_ptr + start + ks * (D + 1) + D, mask=kmask, other=0.0)
        dl += f * (_dot(vt, tl.trans(r)) - u[None, :])
        tl.store(dl_ptr + base_k + offs[:, None] * K + ks[None, :], dl, mask=tk_mask)
        tl.store(dv_ptr + bh * T * D + ts[:, None] * D + ds[None, :],
                 _dot(tl.trans(wt), xt) + _dot(f, r), mask=td_mask)

    @triton.jit
    def linear_local_kernel(a_ptr, b_ptr, g_ptr, loc_ptr, T, NT, M: tl.constexpr,
                            C: tl.constexpr, BM: tl.constexpr):
        """Chunk summary of the linear attention: ``[A^T B | A^T g] [M, M + 1]`` (forward:
        ``A = phi_k``, ``B = v``, ``g = 1``; backward: ``A = phi_q``, ``B = g / z``,
        ``g = -<g, out> / z``), ``g [T]``. Grid ``(NT, B H)``."""
        c = tl.program_id(0)
        bh = tl.program_id(1)
        ts = c * C + tl.arange(0, C)
        ms = tl.arange(0, BM)
        tmask = ts < T
        mmask = ms < M
        tm_mask = tmask[:, None] & mmask[None, :]
        at = tl.load(a_ptr + bh * T * M + ts[:, None] * M + ms[None, :], mask=tm_mask, other=0.0)
        bt = tl.load(b_ptr + bh * T * M + ts[:, None] * M + ms[None, :], mask=tm_mask, other=0.0)
        gt = tl.load(g_ptr + bh * T + ts, mask=tmask, other=0.0)
        base = (bh * NT + c) * M * (M + 1)
        tl.store(loc_ptr + base + ms[:, None] * (M + 1) + ms[None, :], _dot(tl.trans(at), bt),
                 mask=mmask[:, None] & mmask[None, :])
        tl.store(loc_ptr + base + ms * (M + 1) + M, tl.sum(at * gt[:, None], axis=0), mask=mmask)

    @triton.jit
    def linear_out_kernel(q_ptr, k_ptr, v_ptr, start_ptr, out_ptr, z_ptr, T, NT,
                          M: tl.constexpr, C: tl.constexpr, BM: tl.constexpr):
        """``out = (Q S_c + tril(Q K^T) V) / (Q Z_c + rowsum tril(Q K^T))`` per chunk, storing
        the normaliser ``z [T]``; ``start [M, M + 1] = [S_c | Z_c]``. Grid ``(NT, B H)``."""
        c = tl.program_id(0)
        bh = tl.program_id(1)
        offs = tl.arange(0, C)
        ts = c * C + offs
        ms = tl.arange(0, BM)
        tmask = ts < T
        mmask = ms < M
        tm_mask = tmask[:, None] & mmask[None, :]
        rows = bh * T * M + ts[:, None] * M + ms[None, :]
        qt = tl.load(q_ptr + rows, mask=tm_mask, other=0.0)
        kt = tl.load(k_ptr + rows, mask=tm_mask, other=0.0)
        vt = tl.load(v_ptr + rows, mask=tm_mask, other=0.0)
        base = (bh * NT + c) * M * (M + 1)
        s0 = tl.load(start_ptr + base + ms[:, None] * (M + 1) + ms[None, :],
                     mask=mmask[:, None] & mmask[None, :], other=0.0)
        z0 = tl.load(start_ptr + base + ms * (M + 1) + M, mask=mmask, other=0.0)
        scores = tl.where(offs[None, :] <= offs[:, None], _dot(qt, tl.trans(kt)), 0.0)
        norm = tl.sum(qt * z0[None, :], axis=1) + tl.sum(scores, axis=1)
        out = (_dot(qt, s0) + _dot(scores, vt)) * _inverse(norm)[:, None]
        tl.store(out_ptr + rows, out, mask=tm_mask)
        tl.store(z_ptr + bh * T + ts, norm, mask=tmask)

    @triton.jit
    def linear_grad_kernel(q_ptr, k_ptr, v_ptr, gn_ptr, gz_ptr, start_ptr, after_ptr, dq_ptr,
                           dk_ptr, dv_ptr, T, NT, M: tl.constexpr, C: tl.constexpr,
                           BM: tl.constexpr):
        """Gradients of the linear attention per chunk, ``gn = g / z``, ``gz = -<g, out> / z``:
        ``dQ = gn S_c^T + gz Z_c + P K`` with ``P = tril(gn V^T + gz)``;
        ``dK = P^T Q + V dS^T + dZ``; ``dV = tril(Q K^T)^T gn + K dS``, where
        ``[dS | dZ] = after`` sums the later chunks. Grid ``(NT, B H)``."""
        c = tl.program_id(0)
        bh = tl.program_id(1)
        offs = tl.arange(0, C)
        ts = c * C + offs
        ms = tl.arange(0, BM)
        tmask = ts < T
        mmask = ms < M
        tm_mask = tmask[:, None] & mmask[None, :]
        mm_mask = mmask[:, None] & mmask[None, :]
        rows = bh * T * M + ts[:, None] * M + ms[None, :]
        qt = tl.load(q_ptr + rows, mask=tm_mask, other=0.0)
        kt = tl.load(k_ptr + rows, mask=tm_mask, other=0.0)
        vt = tl.load(v_ptr + rows, mask=tm_mask, other=0.0)
        gn = tl.load(gn_ptr + rows, mask=tm_mask, other=0.0)
        gz = tl.load(gz_ptr + bh * T + ts, mask=tmask, other=0.0)
        base = (bh * NT + c) * M * (M + 1)
        s0 = tl.load(start_ptr + base + ms[:, None] * (M + 1) + ms[None, :], mask=mm_mask,
                     other=0.0)
        z0 = tl.load(start_ptr + base + ms * (M + 1) + M, mask=mmask, other=0.0)
        ds = tl.load(after_ptr + base + ms[:, None] * (M + 1) + ms[None, :], mask=mm_mask,
                     other=0.0)
        dz = tl.load(after_ptr + base + ms * (M + 1) + M, mask=mmask, other=0.0)
        causal = offs[None, :] <= offs[:, None]
        p = tl.where(causal, _dot(gn, tl.trans(vt)) + gz[:, None], 0.0)
        scores = tl.where(causal, _dot(qt, tl.trans(kt)), 0.0)
        tl.store(dq_ptr + rows, _dot(gn, tl.trans(s0)) + gz[:, None] * z0[None, :]
                 + _dot(p, kt), mask=tm_mask)
        tl.store(dk_ptr + rows, _dot(tl.trans(p), qt) + _dot(vt, tl.trans(ds)) + dz[None, :],
                 mask=tm_mask)
        tl.store(dv_ptr + rows, _dot(tl.trans(scores), gn) + _dot(kt, ds), mask=tm_mask)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).contiguous()


def _block(n: int) -> int:
    """A tile width ``>= n``: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(n))


def _prefix(loc: torch.Tensor, refs: torch.Tensor, init: torch.Tensor | None,
            reverse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_prefix_kernel` over ``loc [BH, NT, K, W]`` and ``refs [BH, NT + 1, K]``."""
    bh, nt, k, w = loc.shape
    out = torch.empty_like(loc)
    final = None if reverse else torch.empty((bh, k, w), device=loc.device, dtype=torch.float32)
    chunk_prefix_kernel[(bh,)](loc, refs, loc if init is None else init, out,
                               out if final is None else final, nt, K=k, W=w, BK=_block(k),
                               BW=_block(w), REVERSE=reverse)
    return out, final


class _Scan:
    """Everything the three launches share for one scan: the running max, the boundary
    references, the chunk start states (``[BH, NT, K, d + 1]``) and the final state."""

    def __init__(self, logits: torch.Tensor, v: torch.Tensor, state: ScanState, chunk: int):
        b, h, t, k = logits.shape
        d = v.shape[-1]
        self.shape, self.chunk = (b * h, t, k, d), chunk
        self.nt = max(1, triton.cdiv(t, chunk))
        self.logits, self.v = _flat(logits), _flat(v)
        m = _flat(state.m).reshape(b * h, k)
        self.mu = torch.maximum(m[:, None], self.logits.reshape(b * h, t, k).cummax(1).values) \
            if t else m[:, None]
        ends = torch.clamp(torch.arange(1, self.nt + 1, device=v.device) * chunk, max=t) - 1
        self.refs = torch.cat([m[:, None], self.mu.index_select(1, ends)], 1).contiguous()
        self.mu = self.mu.contiguous()
        init = torch.cat([_flat(state.num).reshape(b * h, k, d),
                          _flat(state.den).reshape(b * h, k, 1)], -1).contiguous()
        loc = torch.empty((b * h, self.nt, k, d + 1), device=v.device, dtype=torch.float32)
        chunk_local_kernel[(self.nt, b * h)](self.logits, self.refs, self.v, loc, t, self.nt,
                                             K=k, D=d, C=chunk, BK=_block(k), BD=_block(d))
        self.starts, final = _prefix(loc, self.refs, init, reverse=False)
        self.final = ScanState(m=self.refs[:, -1].reshape(b, h, k),
                               den=final[..., d].reshape(b, h, k),
                               num=final[..., :d].reshape(b, h, k, d).contiguous())

    def launch(self, read: bool, w: torch.Tensor, backward: tuple | None = None):
        """The read (``read``) or the scores of ``w``; with ``backward = (x, p)``, the chunk
        backward summaries of slot weights ``w`` instead."""
        bh, t, k, d = self.shape
        out = torch.empty((bh, t, d if read else k), device=w.device, dtype=torch.float32)
        x, p = backward if backward is not None else (out, out)
        back = torch.empty_like(self.starts) if backward is not None else self.starts
        chunk_out_kernel[(self.nt, bh)](
            self.logits, self.mu, self.refs, self.v, _flat(w), self.starts,
            x if backward is not None else out, p, back, t, self.nt, K=k, D=d, C=self.chunk,
            BK=_block(k), BD=_block(d), READ=read, BACKWARD=backward is not None)
        return back if backward is not None else out

    def grads(self, a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(p, dlogits, dv)`` for upstream slot gradients ``G_s(t) = a[t, s] x_t``."""
        bh, t, k, d = self.shape
        a, x = _flat(a), _flat(x)
        p = self.launch(False, x)
        back = self.launch(True, a, backward=(x, p))
        after, _ = _prefix(back, self.refs, None, reverse=True)
        dlogits = torch.empty((bh, t, k), device=x.device, dtype=torch.float32)
        dv = torch.empty((bh, t, d), device=x.device, dtype=torch.float32)
        chunk_grad_kernel[(self.nt, bh)](
            self.logits, self.mu, self.refs, self.v, a, x, p, self.starts, after, dlogits, dv,
            t, self.nt, K=k, D=d, C=self.chunk, BK=_block(k), BD=_block(d))
        return p, dlogits, dv


def _shaped(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.reshape(*like.shape[:3], x.shape[-1])


class _SlotRead(torch.autograd.Function):
    """``out_t = sum_s a[t, s] slot_s(t)`` on the chunk kernels; the initial state is constant."""

    @staticmethod
    def forward(ctx, a, logits, v, m, den, num, chunk):
        scan = _Scan(logits, v, ScanState(m=m, den=den, num=num), chunk)
        out = _shaped(scan.launch(True, a), v)
        ctx.save_for_backward(a, logits, v, m, den, num)
        ctx.chunk = chunk
        final = scan.final
        ctx.mark_non_differentiable(final.m, final.den, final.num)
        return out, final.m, final.den, final.num

    @staticmethod
    def backward(ctx, grad_out, *unused):
        a, logits, v, m, den, num = ctx.saved_tensors
        scan = _Scan(logits, v, ScanState(m=m, den=den, num=num), ctx.chunk)
        p, dlogits, dv = scan.grads(a, grad_out)
        return (_shaped(p, a), _shaped(dlogits, logits), _shaped(dv, v), None, None, None,
                None)


class _SlotScores(torch.autograd.Function):
    """``out[t, s] = <x_t, slot_s(t)>`` on the chunk kernels; the initial state is constant."""

    @staticmethod
    def forward(ctx, x, logits, v, m, den, num, chunk):
        scan = _Scan(logits, v, ScanState(m=m, den=den, num=num), chunk)
        ctx.save_for_backward(x, logits, v, m, den, num)
        ctx.chunk = chunk
        return _shaped(scan.launch(False, x), logits)

    @staticmethod
    def backward(ctx, grad_out):
        x, logits, v, m, den, num = ctx.saved_tensors
        scan = _Scan(logits, v, ScanState(m=m, den=den, num=num), ctx.chunk)
        y = scan.launch(True, grad_out)
        _, dlogits, dv = scan.grads(grad_out, x)
        return _shaped(y, x), _shaped(dlogits, logits), _shaped(dv, v), None, None, None, None


def _check(name: str, chunk: int) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs the triton package")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"{name}: chunk must be a power of two >= 16, got {chunk}")


def slot_read_triton_chunk(a: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                           state: ScanState | None = None,
                           chunk: int = CHUNK) -> tuple[torch.Tensor, ScanState]:
    """:func:`~.asm_fused_recurrent.slot_read_fused_recurrent` on the chunk kernels (float32).

    Saves only the inputs for the backward pass, which recomputes the chunk start states.
    """
    _check("slot_read_triton_chunk", chunk)
    b, h, _, k = logits.shape
    if state is None:
        state = ScanState.empty(b, h, k, v.shape[-1], v.device, torch.float32)
    out, m, den, num = _SlotRead.apply(a, logits, v, state.m, state.den, state.num, chunk)
    return out, ScanState(m=m, den=den, num=num)


def slot_scores_triton_chunk(x: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                             state: ScanState | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """``<x_t, slot_s(t)>`` ``[B, H, T, K]`` on the chunk kernels (float32)."""
    _check("slot_scores_triton_chunk", chunk)
    b, h, _, k = logits.shape
    if state is None:
        state = ScanState.empty(b, h, k, v.shape[-1], v.device, torch.float32)
    return _SlotScores.apply(x, logits, v, state.m, state.den, state.num, chunk)


def _linear_starts(phi_k: torch.Tensor, v: torch.Tensor, s0: torch.Tensor, z0: torch.Tensor,
                   chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk start states ``[BH, NT, M, M + 1]`` of the linear attention and the final one."""
    bh, t, mm = phi_k.shape
    nt = max(1, triton.cdiv(t, chunk))
    loc = torch.empty((bh, nt, mm, mm + 1), device=v.device, dtype=torch.float32)
    ones = torch.ones((bh, t), device=v.device, dtype=torch.float32)
    linear_local_kernel[(nt, bh)](phi_k, v, ones, loc, t, nt, M=mm, C=chunk, BM=_block(mm))
    refs = torch.zeros((bh, nt + 1, mm), device=v.device, dtype=torch.float32)
    init = torch.cat([s0, z0[..., None]], -1).contiguous()
    return _prefix(loc, refs, init, reverse=False)


class _ChunkLinearAttention(torch.autograd.Function):
    """Causal linear attention on the chunk kernels; the initial state is constant."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, s0, z0, chunk):
        b, h, t, mm = phi_q.shape
        q, k, vv = (_flat(x).reshape(b * h, t, mm) for x in (phi_q, phi_k, v))
        s0f, z0f = _flat(s0).reshape(b * h, mm, mm), _flat(z0).reshape(b * h, mm)
        starts, final = _linear_starts(k, vv, s0f, z0f, chunk)
        nt = starts.shape[1]
        out = torch.empty_like(q)
        norm = torch.empty((b * h, t), device=v.device, dtype=torch.float32)
        linear_out_kernel[(nt, b * h)](q, k, vv, starts, out, norm, t, nt, M=mm, C=chunk,
                                       BM=_block(mm))
        ctx.save_for_backward(phi_q, phi_k, v, out, norm, s0, z0)
        ctx.chunk = chunk
        s, z = final[..., :mm].reshape(b, h, mm, mm), final[..., mm].reshape(b, h, mm)
        ctx.mark_non_differentiable(s, z)
        return out.reshape(b, h, t, mm), s, z

    @staticmethod
    def backward(ctx, grad_out, *unused):
        phi_q, phi_k, v, out, norm, s0, z0 = ctx.saved_tensors
        b, h, t, mm = phi_q.shape
        q, k, vv, g = (_flat(x).reshape(b * h, t, mm) for x in (phi_q, phi_k, v, grad_out))
        starts, _ = _linear_starts(k, vv, _flat(s0).reshape(b * h, mm, mm),
                                   _flat(z0).reshape(b * h, mm), ctx.chunk)
        nt = starts.shape[1]
        inv = torch.where(norm > 0, 1.0 / torch.where(norm > 0, norm, 1.0), 0.0)
        gn = (g * inv[..., None]).contiguous()
        gz = (-(g * out).sum(-1) * inv).contiguous()
        loc = torch.empty_like(starts)
        linear_local_kernel[(nt, b * h)](q, gn, gz, loc, t, nt, M=mm, C=ctx.chunk,
                                         BM=_block(mm))
        after, _ = _prefix(loc, torch.zeros((b * h, nt + 1, mm), device=v.device), None,
                           reverse=True)
        dq, dk, dv = (torch.empty_like(q) for _ in range(3))
        linear_grad_kernel[(nt, b * h)](q, k, vv, gn, gz, starts, after, dq, dk, dv, t, nt,
                                        M=mm, C=ctx.chunk, BM=_block(mm))
        return (dq.reshape(b, h, t, mm), dk.reshape(b, h, t, mm), dv.reshape(b, h, t, mm),
                None, None, None)


def causal_linear_attention_triton_chunk(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~.asm_fused_recurrent.causal_linear_attention_fused_recurrent` on the chunk
    kernels (float32, square ``M x M`` state)."""
    _check("causal_linear_attention_triton_chunk", chunk)
    b, h, _, mm = phi_q.shape
    if v.shape[-1] != mm:
        raise ValueError(f"the Triton kernel needs v of width {mm}, got {v.shape[-1]}")
    if state is None:
        state = (torch.zeros(b, h, mm, mm, device=v.device),
                 torch.zeros(b, h, mm, device=v.device))
    out, s, z = _ChunkLinearAttention.apply(phi_q, phi_k, v, state[0], state[1], chunk)
    return out, (s, z)


def asa_attend_triton_chunk(
    logits: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    key_logits: torch.Tensor,
    gamma: torch.Tensor | float,
    read_temperature: float = 1.0,
    refine: Refine | None = None,
    state: ScanState | None = None,
    gate: torch.Tensor | float | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ScanState]:
    """:func:`~.asm_fused_recurrent.asa_attend_fused_recurrent` on the chunk kernels (same
    arguments and results)."""
    return attend_through(partial(slot_scores_triton_chunk, chunk=chunk),
                          partial(slot_read_triton_chunk, chunk=chunk), logits, v, q, key_logits,
                          gamma, read_temperature, refine, state, gate)
