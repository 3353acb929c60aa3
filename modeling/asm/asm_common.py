"""What the forms of the ASM kernels share: the scan state, the reference bands of the chunked
scan, the read of refined weights, and safe reciprocals. Shapes as in README.md beside this file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["TINY", "Bands", "Refine", "ScanState", "attend_through", "band_width",
           "read_refined", "safe_reciprocal", "scan_bands"]

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


def safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` where ``x > 0``, else 0 (an empty slot reads as zero; gradients stay finite)."""
    positive = x > 0
    return torch.where(positive, 1.0 / torch.where(positive, x, torch.ones_like(x)),
                       torch.zeros_like(x))


def band_width(dtype: torch.dtype) -> float:
    """Width ``X`` of one reference band of the chunked scan, ``0.45 log(max float)``: about 40
    in float32, 319 in float64. Within a band ``1 / D <= e^X`` and its square (in the
    reciprocal's gradient) stay finite, and every term that can matter,
    ``e^(l - ref) >= e^(-X - 40)``, is a normal number."""
    return 0.45 * math.log(torch.finfo(dtype).max)


@dataclass
class Bands:
    """Reference bands of the chunked scan for every position (see :func:`scan_bands`)."""

    mu: torch.Tensor  # running max [B, H, T, K], -inf before a slot's first write
    level: torch.Tensor | None  # [B, H, T, K]: floor((c - mu) / X), c the chunk's reference
    rank: torch.Tensor | None  # [B, H, T, K] long: index of the position's band in its chunk
    count: list[int]  # bands per chunk


def scan_bands(logits: torch.Tensor, m: torch.Tensor, step: int, width: float) -> Bands:
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
        return Bands(mu, None, None, [1] * t)
    idx = torch.arange(t, device=mu.device)
    starts = idx // step * step
    ends = torch.clamp(starts + step - 1, max=t - 1)
    written = mu > float("-inf")
    level = torch.floor(torch.where(written, mu.index_select(2, ends) - mu,
                                    torch.zeros_like(mu)) / width)
    if not bool(level.any()):  # the usual case: one reference per chunk
        return Bands(mu, None, None, [1] * ((t + step - 1) // step))
    change = torch.zeros_like(written)
    change[:, :, 1:] = (written[:, :, 1:] & written[:, :, :-1]
                        & (level[:, :, 1:] != level[:, :, :-1]))
    change &= (idx % step != 0)[:, None]
    seen = change.cumsum(dim=2)
    rank = seen.index_select(2, ends) - seen  # band changes after t: 0 at the chunk's end
    top = rank.amax(dim=(0, 1, 3))  # [T]
    top = torch.cat([top, top.new_zeros((-t) % step)]).view(-1, step).amax(dim=1)
    return Bands(mu, level, rank, [int(x) + 1 for x in top.tolist()])


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


def attend_through(scores: Callable, read: Callable, logits: torch.Tensor, v: torch.Tensor,
                   q: torch.Tensor, key_logits: torch.Tensor, gamma: torch.Tensor | float,
                   read_temperature: float, refine: Refine | None, state: ScanState | None,
                   gate: torch.Tensor | float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ScanState]:
    """The scan + read composed from two float32 kernels (the Triton forms):
    ``scores(x, logits, v, state) -> <x_t, slot_s(t)>`` and
    ``read(a, logits, v, state) -> (sum_s a[t, s] slot_s(t), final state)``: content scores,
    read weights, refinement, then one read of ``r + gate w`` (with a gate) or the reads of
    ``r`` and ``w``. Arguments and results as in ``asa_attend_chunk_autograd``."""
    gamma = torch.as_tensor(gamma, dtype=torch.float32, device=v.device)
    gamma = gamma.view(1, -1, 1, 1) if gamma.dim() == 1 else gamma
    content = scores(q, logits, v, state)
    r = torch.softmax((key_logits.float() + gamma * content) / read_temperature, dim=-1)
    w = refine(r).float() if refine is not None else None
    if w is not None and gate is not None:
        o, final = read(r + torch.as_tensor(gate, dtype=torch.float32) * w, logits, v, state)
        return o, r, None, final
    o, final = read(r, logits, v, state)
    delta = read(w, logits, v, state)[0] if w is not None else None
    return o, r, delta, final


TINY = {t: torch.finfo(t).tiny for t in (torch.float32, torch.float64)}
