"""The chunk form of the ASM kernels in PyTorch ops, differentiated by autograd.

Exact and independent of the chunk size (README.md beside this file, "Exact chunk-parallel
scan"): inside a chunk all terms of one position share one reference per slot, lowered in bands
where a running max is far below it. It handles every chunk (several bands included), so it is
the general path, and what :mod:`.asm_chunk`'s hand-written backward is tested against. Both
take and return the recurrent state, so prefill, chunked prefill and decoding run the same maths.
"""

from __future__ import annotations

import torch

from .asm_common import Refine, ScanState, band_width, read_refined, safe_reciprocal, scan_bands

__all__ = ["asa_attend_chunk_autograd", "causal_linear_attention_chunk_autograd"]


def asa_attend_chunk_autograd(
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
    """Exact chunk-parallel scan + read; same arguments and results as :func:`asa_attend_naive`,
    computed in ``float32`` or wider, plus the final :class:`ScanState`.

    Per chunk of ``C`` positions and slot ``s``: the chunk's reference
    ``c_s = max(m_s, max_chunk l)``, the running max ``mu_s(t)`` (the carried ``m_s`` included)
    and, for position ``t``, the banded reference ``ref_s(t) = c_s - X floor((c_s - mu_s(t)) / X)``
    (``X``: :func:`band_width`, about 40 in float32), so ``mu_s(t) - ref_s(t)`` lies in
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
    width = band_width(dt)
    bands = scan_bands(logits, m, step, width)
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


def causal_linear_attention_chunk_autograd(
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
        outs.append(numer * safe_reciprocal(denom))
        s = s + kc.transpose(-1, -2) @ vc
        z = z + kc.sum(dim=2)
    return torch.cat(outs, dim=2), (s, z)
