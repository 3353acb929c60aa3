"""The banks merged into the stock attention's output in one Triton kernel (CUDA).

:func:`~hf_memory.steering.mixture.bank_mixture_by_lse` in PyTorch ops is about fifteen kernels
per steered layer and decoding step (slot products, the contrastive gate's two log-sum-exps, the
softmax over [history ; slots], the read, the merge, the layout), and on a GPU host that issues a
kernel every few tens of microseconds a steered step's time is its launch count
(BENCHMARKS.md, "Steered generation through the stock kernel's log-sum-exp, on a GPU").
:func:`fused_bank_mixture_by_lse` computes the same output in one kernel: a program per block of
16 query rows of one steered head scores the rows against that head's slots (pre- or post-RoPE
per column), folds in the gate, takes the softmax with the history's evidence
``lse − log T_t`` as one more column, reads the slot values and merges them with the history's
output, then writes the attention layout ``[B, T, Hs, D]``. It reads every operand through its
strides (no copy) and computes in float32, products included (``ieee``: no TF32), as the PyTorch
path does.

:func:`fused_merge_applies` says when it runs: a CUDA tensor, Triton installed, float32 slots
(the compute dtype of half and float32 models), head width × slot count up to 128 × 128 (each
padded to a power of two: Gemma's 256-wide heads with up to 64 slots), and not
while ``torch.compile`` traces (inductor fuses the PyTorch ops itself there). Everything else
takes the PyTorch path, which stays the reference the tests compare this kernel with (on the
CPU through ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from hf_memory.steering.mixture import HeadSlots

try:
    import triton
    import triton.language as tl
except ImportError:  # the optional extra: without it every site takes the PyTorch path
    triton = None

__all__ = ["fused_bank_mixture_by_lse", "fused_merge_applies"]

# A program holds one head's slot keys and values as [head width, slots] float32 tiles (both
# padded to powers of two): 64 KiB each at most, within a GPU's shared memory for tl.dot.
_MAX_TILE = 128 * 128
_ROWS = 16  # query rows per program (the smallest tl.dot tile)


def _tile(width: int, slots: int) -> int:
    return max(16, 1 << (width - 1).bit_length()) * max(16, 1 << (slots - 1).bit_length())


def fused_merge_applies(query: torch.Tensor, slots: HeadSlots) -> bool:
    """Whether :func:`fused_bank_mixture_by_lse` runs for this site's query and slots."""
    return (triton is not None and query.is_cuda and slots.keys_t.is_cuda
            and slots.keys_t.dtype == torch.float32
            and _tile(query.shape[-1], slots.keys_t.shape[-1]) <= _MAX_TILE
            and not torch.compiler.is_compiling())


def fused_bank_mixture_by_lse(
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
    """:func:`~hf_memory.steering.mixture.bank_mixture_by_lse` (same arguments, same result up
    to float32 rounding) in one Triton kernel; CUDA, or the interpreter
    (``TRITON_INTERPRET=1``) for tests."""
    if triton is None:
        raise RuntimeError("fused_bank_mixture_by_lse needs Triton "
                           "(pip install 'hf-memory[triton]')")
    if slots.keys_t.dtype != torch.float32:
        raise ValueError(f"fused_bank_mixture_by_lse computes in float32; the slots are "
                         f"{slots.keys_t.dtype} (use bank_mixture_by_lse)")
    b, heads, t, d = q_post.shape
    m = slots.keys_t.shape[-1]
    if _tile(d, m) > _MAX_TILE:
        raise ValueError(f"fused_bank_mixture_by_lse holds head width × slots up to "
                         f"{_MAX_TILE} (each padded to a power of two); got {d} × {m} "
                         "(use bank_mixture_by_lse)")
    out = torch.empty(b, t, heads, d, dtype=out_dtype or torch.float32, device=q_post.device)
    counted = size_normalize and isinstance(log_count, torch.Tensor)
    count = (log_count.to(torch.float32).expand(b, heads, t) if counted
             else lse)  # (unread without a count tensor: any pointer will do)
    constant = float(log_count) if size_normalize and not counted else 0.0
    gated = slots.swing is not None
    target = slots.target if gated else slice(0, 0)
    reference = slots.reference if gated else slice(0, 0)
    dummy = slots.base  # stands in for the tensors a case does not read
    grid = (triton.cdiv(b * t, _ROWS), heads)
    _merge[grid](
        history, lse, q_pre, q_post, count, out,
        slots.keys_t, slots.values, slots.base,
        slots.swing if gated else dummy,
        dummy if slots.post_columns is None else slots.post_columns,
        b * t, t, d, m, float(scaling), float(gamma), float(strength), constant,
        float(slots.gate_offset), target.start, target.stop, reference.start, reference.stop,
        *history.stride(), *lse.stride(), *q_pre.stride(), *q_post.stride(), *count.stride(),
        *out.stride(),
        COUNTED=counted, GATED=gated,
        ROTATION=("pre" if slots.post_columns is None else
                  "post" if slots.all_post else "mixed"),
        ROWS=_ROWS, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=max(16, triton.next_power_of_2(m)))
    return out


if triton is not None:
    @triton.jit
    def _rows_of(ptr, stride_b, stride_h, stride_t, stride_d, bt, tt, h, dd, row_ok, d_ok):
        """A ``[ROWS, BLOCK_D]`` tile of a ``[B, H, T, D]`` tensor for head ``h``, in float32."""
        offset = bt * stride_b + h * stride_h + tt * stride_t
        return tl.load(ptr + offset[:, None] + dd[None, :] * stride_d,
                       mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _masked_lse(x, columns):
        """Log-sum-exp along axis 1 of ``x`` over the ``columns`` (a non-empty mask)."""
        kept = tl.where(columns[None, :], x, float("-inf"))
        top = tl.max(kept, axis=1)
        return top + tl.log(tl.sum(tl.exp(kept - top[:, None]), axis=1))

    @triton.jit
    def _merge(
        history, lse, q_pre, q_post, count, out, keys_t, values, base, swing, post,
        rows, T, D, M, scaling, gamma, strength, constant, gate_offset,
        target_start, target_stop, reference_start, reference_stop,
        sh_b, sh_h, sh_t, sh_d, sl_b, sl_h, sl_t, sp_b, sp_h, sp_t, sp_d,
        sq_b, sq_h, sq_t, sq_d, sc_b, sc_h, sc_t, so_b, so_t, so_h, so_d,
        COUNTED: tl.constexpr, GATED: tl.constexpr, ROTATION: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        h = tl.program_id(1)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        dd = tl.arange(0, BLOCK_D)
        mm = tl.arange(0, BLOCK_M)
        row_ok, d_ok, m_ok = r < rows, dd < D, mm < M
        bt, tt = r // T, r % T
        slot_ok = d_ok[:, None] & m_ok[None, :]
        keys = tl.load(keys_t + h * D * M + dd[:, None] * M + mm[None, :], mask=slot_ok,
                       other=0.0)
        if ROTATION == "post":
            raw = tl.dot(_rows_of(q_post, sq_b, sq_h, sq_t, sq_d, bt, tt, h, dd, row_ok, d_ok),
                         keys, input_precision="ieee")
        else:
            raw = tl.dot(_rows_of(q_pre, sp_b, sp_h, sp_t, sp_d, bt, tt, h, dd, row_ok, d_ok),
                         keys, input_precision="ieee")
            if ROTATION == "mixed":
                rotated = tl.dot(
                    _rows_of(q_post, sq_b, sq_h, sq_t, sq_d, bt, tt, h, dd, row_ok, d_ok), keys,
                    input_precision="ieee")
                on_post = tl.load(post + mm, mask=m_ok, other=0) != 0
                raw = tl.where(on_post[None, :], rotated, raw)
        raw = raw * scaling
        logits = raw + tl.load(base + mm, mask=m_ok, other=0.0)[None, :]
        if GATED:  # eq. 8-9: σ(γΔ) times each column's swing
            gap = (_masked_lse(raw, (mm >= target_start) & (mm < target_stop))
                   - _masked_lse(raw, (mm >= reference_start) & (mm < reference_stop))
                   - gate_offset) * gamma
            weight = tl.load(swing + mm, mask=m_ok, other=0.0)
            logits += tl.sigmoid(gap)[:, None] * weight[None, :]
        logits = tl.where(m_ok[None, :], logits, float("-inf"))
        evidence = tl.load(lse + bt * sl_b + h * sl_h + tt * sl_t, mask=row_ok,
                           other=0.0).to(tl.float32) - constant
        if COUNTED:
            evidence -= tl.load(count + bt * sc_b + h * sc_h + tt * sc_t, mask=row_ok, other=0.0)
        top = tl.maximum(tl.max(logits, axis=1), evidence)
        spread = tl.exp(logits - top[:, None])
        own = tl.exp(evidence - top)
        total = own + tl.sum(spread, axis=1)
        read = tl.dot(spread / total[:, None],
                      tl.load(values + h * M * D + mm[:, None] * D + dd[None, :],
                              mask=m_ok[:, None] & d_ok[None, :], other=0.0),
                      input_precision="ieee")
        keep = (own / total) * strength + (1.0 - strength)  # toward(h, mixture, strength)
        plain = _rows_of(history, sh_b, sh_h, sh_t, sh_d, bt, tt, h, dd, row_ok, d_ok)
        mixed = read * strength + keep[:, None] * plain
        target = out + (bt * so_b + tt * so_t + h * so_h)[:, None] + dd[None, :] * so_d
        tl.store(target, mixed.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
