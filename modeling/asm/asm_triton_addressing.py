"""The slot addressing of an ASA block fused into one Triton launch per pass (issue 81).

From the heads' keys and queries ``key, q [B, H, T, d]`` and the slot keys ``[H, K, d]``:

- ``logits[b, h, t, s] = write_scale <rot(key)[b, h, t], slot_keys[h, s]>
  + recency[h] positions[b, t]``, ``-inf`` where ``~valid[b, t]``;
- ``key_logits[b, h, t, s] = read_scale <q[b, h, t], slot_keys[h, s]>``;

``rot(x) = x cos + roll(x, d // 2) sin`` with the tables of ``modeling_asm._rotary_tables``.
:func:`~.asm_naive.slot_addressing_naive` is the reference; :func:`slot_addressing_triton` runs
one program per (block of ``BLOCK_T`` positions, batch * head) forward and backward: the
rotation and the mask in-kernel, products in float32 (``tl.dot`` with
``input_precision="ieee"``), every output written once. The reductions over batch and time
(``dslot_keys``, ``drecency``) go through per-program partial sums summed by PyTorch afterwards,
not ``tl.atomic_add``: the result is deterministic run to run, at a scratch of ``K / BLOCK_T``
times ``dkey``'s size. Without the triton package the Triton form raises; the reference needs no
Triton.
"""

from __future__ import annotations

import os

import torch

from .asm_fused_recurrent import triton

__all__ = ["slot_addressing_triton"]

BLOCK_T = 32  # positions per program
MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16 on the GPU

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dot(a, b):
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _tile(ptr, rows, cols, mask, s_row, s_col):
        """``ptr[rows, cols]`` in float32 (0 outside ``mask``)."""
        return tl.load(ptr + rows[:, None] * s_row + cols[None, :] * s_col, mask=mask,
                       other=0.0).to(tl.float32)

    @triton.jit
    def _rotated(key_ptr, cos_ptr, sin_ptr, ts, ds, td_mask, s_kt, s_kd, s_ct, s_cd, s_st,
                 s_sd, D: tl.constexpr, ROTARY: tl.constexpr):
        """The key tile ``[BT, BD]``, rotated: ``key cos + key[(j - d // 2) mod d] sin``."""
        key = _tile(key_ptr, ts, ds, td_mask, s_kt, s_kd)
        if ROTARY:
            rolled = _tile(key_ptr, ts, (ds + D - D // 2) % D, td_mask, s_kt, s_kd)
            cos = _tile(cos_ptr, ts, ds, td_mask, s_ct, s_cd)
            sin = _tile(sin_ptr, ts, ds, td_mask, s_st, s_sd)
            key = key * cos + rolled * sin
        return key

    @triton.jit
    def slot_addressing_fwd_kernel(
            key_ptr, q_ptr, sk_ptr, cos_ptr, sin_ptr, pos_ptr, valid_ptr, rec_ptr,
            logits_ptr, kl_ptr, T, H, write_scale, read_scale,
            s_kb, s_kh, s_kt, s_kd, s_qb, s_qh, s_qt, s_qd, s_sh, s_sk, s_sd,
            s_cb, s_ct, s_cd, s_sb, s_st, s_snd, s_pb, s_pt, s_vb, s_vt,
            K: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
            BD: tl.constexpr, ROTARY: tl.constexpr, RECENCY: tl.constexpr):
        """``logits`` and ``key_logits`` ``[B, H, T, K]`` (contiguous float32) of one block
        of positions; grid ``(cdiv(T, BT), B H)``. Inputs by strides (``cos, sin``:
        ``[B, T, d]``, ``positions, valid``: ``[B, T]``)."""
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        ts = tl.program_id(0) * BT + tl.arange(0, BT)
        ks = tl.arange(0, BK)
        ds = tl.arange(0, BD)
        tmask = ts < T
        kmask = ks < K
        td_mask = tmask[:, None] & (ds < D)[None, :]
        sk = _tile(sk_ptr + h * s_sh, ks, ds, kmask[:, None] & (ds < D)[None, :], s_sk, s_sd)
        key = _rotated(key_ptr + b * s_kb + h * s_kh, cos_ptr + b * s_cb, sin_ptr + b * s_sb,
                       ts, ds, td_mask, s_kt, s_kd, s_ct, s_cd, s_st, s_snd, D, ROTARY)
        logits = _dot(key, tl.trans(sk)) * write_scale
        if RECENCY:
            pos = tl.load(pos_ptr + b * s_pb + ts * s_pt, mask=tmask, other=0).to(tl.float32)
            logits += tl.load(rec_ptr + h).to(tl.float32) * pos[:, None]
        valid = tl.load(valid_ptr + b * s_vb + ts * s_vt, mask=tmask, other=0) != 0
        logits = tl.where(valid[:, None], logits, float("-inf"))
        q = _tile(q_ptr + b * s_qb + h * s_qh, ts, ds, td_mask, s_qt, s_qd)
        out = bh * T * K + ts[:, None] * K + ks[None, :]
        tk_mask = tmask[:, None] & kmask[None, :]
        tl.store(logits_ptr + out, logits, mask=tk_mask)
        tl.store(kl_ptr + out, _dot(q, tl.trans(sk)) * read_scale, mask=tk_mask)

    @triton.jit
    def slot_addressing_bwd_kernel(
            key_ptr, q_ptr, sk_ptr, cos_ptr, sin_ptr, pos_ptr, valid_ptr, dl_ptr, dkl_ptr,
            dkey_ptr, dq_ptr, dsk_ptr, drec_ptr, T, H, write_scale, read_scale,
            s_kb, s_kh, s_kt, s_kd, s_qb, s_qh, s_qt, s_qd, s_sh, s_sk, s_sd,
            s_cb, s_ct, s_cd, s_sb, s_st, s_snd, s_pb, s_pt, s_vb, s_vt,
            K: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
            BD: tl.constexpr, ROTARY: tl.constexpr, RECENCY: tl.constexpr):
        """Backward of one block for the upstream ``dl, dkl [B, H, T, K]`` (contiguous float32,
        ``dl`` zeroed where masked): ``dkey, dq [B, H, T, d]`` (through the transposed
        rotation: ``drot cos + (drot sin)[(i + d // 2) mod d]``) and the program's partial sums
        ``dsk [K, d]`` and ``drec`` at row ``program_id(0) * B H + bh`` of the scratch."""
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        part = tl.program_id(0) * tl.num_programs(1) + bh
        ts = tl.program_id(0) * BT + tl.arange(0, BT)
        ks = tl.arange(0, BK)
        ds = tl.arange(0, BD)
        tmask = ts < T
        kmask = ks < K
        dmask = ds < D
        td_mask = tmask[:, None] & dmask[None, :]
        tk_mask = tmask[:, None] & kmask[None, :]
        kd_mask = kmask[:, None] & dmask[None, :]
        sk_base = sk_ptr + h * s_sh
        sk = _tile(sk_base, ks, ds, kd_mask, s_sk, s_sd)
        valid = tl.load(valid_ptr + b * s_vb + ts * s_vt, mask=tmask, other=0) != 0
        grads = bh * T * K + ts[:, None] * K + ks[None, :]
        dl = tl.load(dl_ptr + grads, mask=tk_mask, other=0.0)
        dl = tl.where(valid[:, None], dl, 0.0)
        g = dl * write_scale
        gq = tl.load(dkl_ptr + grads, mask=tk_mask, other=0.0) * read_scale
        rows = bh * T * D + ts[:, None] * D + ds[None, :]
        if ROTARY:
            shifted = (ds + D // 2) % D
            sin_rolled = _tile(sin_ptr + b * s_sb, ts, shifted, td_mask, s_st, s_snd)
            cos = _tile(cos_ptr + b * s_cb, ts, ds, td_mask, s_ct, s_cd)
            sk_rolled = _tile(sk_base, ks, shifted, kd_mask, s_sk, s_sd)
            dkey = _dot(g, sk) * cos + _dot(g, sk_rolled) * sin_rolled
        else:
            dkey = _dot(g, sk)
        tl.store(dkey_ptr + rows, dkey, mask=td_mask)
        q = _tile(q_ptr + b * s_qb + h * s_qh, ts, ds, td_mask, s_qt, s_qd)
        tl.store(dq_ptr + rows, _dot(gq, sk), mask=td_mask)
        key = _rotated(key_ptr + b * s_kb + h * s_kh, cos_ptr + b * s_cb, sin_ptr + b * s_sb,
                       ts, ds, td_mask, s_kt, s_kd, s_ct, s_cd, s_st, s_snd, D, ROTARY)
        dsk = _dot(tl.trans(g), key) + _dot(tl.trans(gq), q)
        tl.store(dsk_ptr + part * K * D + ks[:, None] * D + ds[None, :], dsk, mask=kd_mask)
        if RECENCY:
            pos = tl.load(pos_ptr + b * s_pb + ts * s_pt, mask=tmask, other=0).to(tl.float32)
            tl.store(drec_ptr + part, tl.sum(tl.sum(dl, axis=1) * pos, axis=0))


def _geometry(key: torch.Tensor, slot_keys: torch.Tensor) -> dict:
    _, _, t, d = key.shape
    k = slot_keys.shape[1]
    return dict(K=k, D=d, BT=max(MIN_BLOCK, min(BLOCK_T, triton.next_power_of_2(t))),
                BK=max(MIN_BLOCK, triton.next_power_of_2(k)),
                BD=max(MIN_BLOCK, triton.next_power_of_2(d)))


def _strides(key, q, slot_keys, cos, sin, positions, valid) -> list[int]:
    return [*key.stride(), *q.stride(), *slot_keys.stride(), cos.stride(0), cos.stride(2),
            cos.stride(3), sin.stride(0), sin.stride(2), sin.stride(3), *positions.stride(),
            *valid.stride()]


class _SlotAddressing(torch.autograd.Function):
    """:func:`slot_addressing_triton`; ``cos, sin`` are ``[B, 1, T, d]`` float32 views (dummy
    without rotary), ``recency`` may be None."""

    @staticmethod
    def forward(ctx, key, q, slot_keys, recency, cos, sin, positions, valid, rotary,
                write_scale, read_scale):
        b, h, t, _ = key.shape
        geo = _geometry(key, slot_keys)
        logits = torch.empty((b, h, t, geo["K"]), device=key.device, dtype=torch.float32)
        key_logits = torch.empty_like(logits)
        grid = (triton.cdiv(t, geo["BT"]), b * h)
        has_recency = recency is not None
        slot_addressing_fwd_kernel[grid](
            key, q, slot_keys, cos, sin, positions, valid,
            recency if has_recency else logits, logits, key_logits, t, h, write_scale,
            read_scale, *_strides(key, q, slot_keys, cos, sin, positions, valid), **geo,
            ROTARY=rotary, RECENCY=has_recency)
        ctx.save_for_backward(key, q, slot_keys, recency, cos, sin, positions, valid)
        ctx.rotary, ctx.scales, ctx.geo = rotary, (write_scale, read_scale), geo
        return logits, key_logits

    @staticmethod
    def backward(ctx, grad_logits, grad_key_logits):
        key, q, slot_keys, recency, cos, sin, positions, valid = ctx.saved_tensors
        b, h, t, d = key.shape
        geo = ctx.geo
        grid = (triton.cdiv(t, geo["BT"]), b * h)
        dkey = torch.empty((b, h, t, d), device=key.device, dtype=torch.float32)
        dq = torch.empty_like(dkey)
        dsk = torch.empty((grid[0], b, h, geo["K"], d), device=key.device, dtype=torch.float32)
        drec = torch.empty((grid[0], b, h), device=key.device, dtype=torch.float32)
        slot_addressing_bwd_kernel[grid](
            key, q, slot_keys, cos, sin, positions, valid,
            grad_logits.to(torch.float32).contiguous(),
            grad_key_logits.to(torch.float32).contiguous(), dkey, dq, dsk, drec, t, h,
            *ctx.scales, *_strides(key, q, slot_keys, cos, sin, positions, valid), **geo,
            ROTARY=ctx.rotary, RECENCY=recency is not None)
        drecency = None if recency is None else drec.sum((0, 1)).to(recency.dtype)
        return (dkey.to(key.dtype), dq.to(q.dtype), dsk.sum((0, 1)).to(slot_keys.dtype),
                drecency, None, None, None, None, None, None, None)


def slot_addressing_triton(
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
    """:func:`~.asm_naive.slot_addressing_naive` on the Triton kernels: float32 results (products
    in float32 whatever the input dtype), gradients to ``key, q, slot_keys, recency`` in
    their dtypes. Inputs are read through their strides (no copies: ``key`` may be the
    heads' transposed view); ``rotary`` tables broadcast over ``[B, 1, T, d]``."""
    if triton is None:
        raise RuntimeError("slot_addressing_triton needs the triton package")
    if not key.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("slot_addressing_triton needs CUDA tensors (or TRITON_INTERPRET=1 "
                           "set before triton kernels are imported)")
    b, h, t, d = key.shape
    if q.shape != key.shape or slot_keys.shape[0] != h or slot_keys.shape[2] != d:
        raise ValueError(f"shapes: key {tuple(key.shape)}, q {tuple(q.shape)}, "
                         f"slot_keys {tuple(slot_keys.shape)} (want [B, H, T, d] twice, [H, K, d])")
    if recency is not None and recency.shape != (h,):
        raise ValueError(f"recency must be [H] = [{h}], got {tuple(recency.shape)}")
    if rotary is None:
        cos = sin = torch.zeros((), device=key.device).expand(b, 1, t, d)
    else:
        cos, sin = (y.to(torch.float32).expand(b, 1, t, d) for y in rotary)
    valid = valid if valid.dtype == torch.bool else valid.to(torch.bool)
    recency = None if recency is None else recency.contiguous()
    return _SlotAddressing.apply(key, q, slot_keys, recency, cos, sin, positions, valid,
                                 rotary is not None, float(write_scale), float(read_scale))
