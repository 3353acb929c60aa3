"""The slot addressing of an ASA layer in few PyTorch operations: write and read logits.

``logits[b, h, t, s] = write_scale <rot(key)_t, slot_keys[h, s]> + recency[h] position[b, t]``
(``-inf`` where the token is padding) and ``key_logits[b, h, t, s] = read_scale <q_t,
slot_keys[h, s]>``: the scale folded into the ``[H, K, d]`` slot keys once, not applied to the
``[B, H, T, K]`` logits (two products: one over the keys and queries concatenated cost more in
the copy than it saved, 0.9 ms of a 64 ms block fwd + bwd on the CPU), the rotary map in two
passes (``addcmul``), the recency bias in one ``addcmul`` and the padding in one ``where``.
:func:`~.asm_naive.slot_addressing_naive` is the reference it is tested against; the Triton
form does the same in one launch each way.
"""

from __future__ import annotations

import torch

__all__ = ["slot_addressing_torch"]


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x [B, H, T, d]`` rotated by the half-split tables ``(cos, sin)`` ``[B, 1, T, d]``
    (``cos = [c, c]``, ``sin = [-s, s]``): ``x cos + roll(x, d / 2) sin``."""
    cos, sin = (y.to(x.dtype) for y in rotary)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def slot_addressing_torch(
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
    """``(logits, key_logits)`` ``[B, H, T, K]`` from ``key, q [B, H, T, d]``, ``slot_keys
    [H, K, d]``, the write keys' rotary tables (or None), ``positions, valid [B, T]`` and the
    per-head recency coefficients ``[H]`` (or None). ``logits`` in ``promote_types(key.dtype,
    float32)``; ``key_logits`` in the inputs' dtype."""
    stat = torch.promote_types(key.dtype, torch.float32)
    if rotary is not None:
        key = rotate(key, rotary)
    slots = (slot_keys * read_scale).to(q.dtype).transpose(1, 2)  # [H, d, K]
    logits, key_logits = (key @ slots).to(stat), q @ slots
    if write_scale != read_scale:
        logits = logits * (write_scale / read_scale)
    if recency is not None:
        logits = torch.addcmul(logits, recency.to(stat)[None, :, None, None],
                               positions.to(stat)[:, None, :, None])
    return torch.where(valid[:, None, :, None], logits, float("-inf")), key_logits
