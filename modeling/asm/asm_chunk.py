"""The chunk form of the ASM kernels with hand-written backwards: the default PyTorch path.

Same maths as :func:`~modeling.asm.asm_chunk_autograd.asa_attend_chunk_autograd` and
:func:`~modeling.asm.asm_chunk_autograd.causal_linear_attention_chunk_autograd` (autograd
through ops, what these are tested against), with every chunk of a sequence in one batched product
(``[B H NC, C, *]``) and only the chunk-to-chunk state recurrence in a Python loop.

Scan + read, for chunks whose positions all share the chunk's reference
``c_s = max(m_s, max_{tau <= chunk end} l_{tau, s})`` (one band: the usual case; a chunk whose
running max rises by the band width or more returns ``None`` and the caller takes the autograd
chunk form): ``e[tau, s] = exp(l[tau, s] - c_s)``, ``D_s(t) = den_prev_s + sum_{tau<=t} e``,
``inv = 1 / D`` where written (else 0) and, for any per-position vector ``x_t`` and weights
``a[t, s]``,

* scores ``<x_t, slot_s(t)> = inv * (x @ num_prev^T + tril(x v^T) @ e)``,
* read ``sum_s a[t, s] slot_s(t) = (a inv) @ num_prev + tril((a inv) @ e^T) @ v``.

Backward of either, with ``G[t, s] = coef[t, s] x_t`` the gradient of ``slot_s(t)`` (scores:
``coef`` the incoming gradient, ``x`` the queries; read: ``coef = a``, ``x`` the incoming
gradient) and ``pdot[t, s] = <x_t, slot_s(t)>``, ``Bc = coef * inv``: inside a chunk
``dl[tau, s] = e[tau, s] sum_{t >= tau} Bc[t, s] (<x_t, v_tau> - pdot[t, s])`` and
``dv_tau = sum_s e[tau, s] sum_{t >= tau} Bc[t, s] x_t``; across chunks through the state at each
chunk's end (``dnum, dden``, carried backwards with the chunks' rescaling factors), which adds
``e (dden + v . dnum)`` to ``dl`` and ``e @ dnum`` to ``dv``. The forward keeps the chunk
products it needs (``tril(q v^T)``, ``tril((a inv) e^T)``) and the per-chunk ``e, inv``;
the backward recomputes nothing of size ``[B, H, T, K, d]``.
"""

from __future__ import annotations

import torch

from .asm_chunk_autograd import asa_attend_chunk_autograd
from .asm_common import Refine, ScanState, band_width, read_refined, safe_reciprocal

__all__ = ["asa_attend_chunk", "causal_linear_attention_chunk"]


class _ScanCache:
    """Forward intermediates of one scan, shared by the scores and read Functions.

    All chunked tensors are 3-D, ``N = B H NC`` chunks first, ``C`` positions per chunk:
    ``ei [N, C + K, K]`` is ``e`` over the ``K x K`` identity, ``vn [N, C + K, d]`` the chunk's
    values over its carried state ``num_prev`` (at the chunk's reference), so that one product
    gives both the intra-chunk and the carried-state terms (``inv * (x vn^T) ei`` are the
    scores, ``((a inv) ei^T) vn`` the read, the first ``C`` columns of ``x vn^T`` and of
    ``(a inv) ei^T`` masked to the causal triangle); ``inv [N, C, K]``; ``ends [B H, NC, K]``
    the running max at each chunk's end and ``refs`` the chunks' references (``ends``, 0
    before a slot's first write)."""

    ei: torch.Tensor
    vn: torch.Tensor
    inv: torch.Tensor
    ends: torch.Tensor
    refs: torch.Tensor
    final: ScanState
    pending: list  # (backward pass, term) of the reads, for the scores' backward
    shape: tuple[int, int, int, int]  # (B, H, T, NC)
    step: int

    @property
    def e(self) -> torch.Tensor:
        return self.ei[:, :self.step]

    @property
    def v(self) -> torch.Tensor:
        return self.vn[:, :self.step]


def _chunks(x: torch.Tensor, nc: int, step: int, fill: float = 0.0) -> torch.Tensor:
    """``[B, H, T, w] -> [B H NC, C, w]`` (contiguous), padded at the end with ``fill``."""
    b, h, t, w = x.shape
    pad = nc * step - t
    if pad:
        x = torch.cat([x, x.new_full((b, h, pad, w), fill)], dim=2)
    return x.reshape(b * h * nc, step, w)


def _unchunk(x: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``[B H NC, C, w] -> [B, H, T, w]`` (a view)."""
    b, h, t, nc = shape
    x = x.view(b, h, -1, x.shape[-1])
    return x[:, :, :t] if x.shape[2] != t else x


def _causal_weights(sources: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``w[:, i, j] = exp(sources[:, j] - rows[:, i])`` for ``j <= i``, else 0: ``sources,
    rows [B H, N, K]`` -> ``[B H, N, N, K]`` (source ``j`` reaches row ``i`` from ``j`` on)."""
    n = rows.shape[1]
    keep = torch.ones(n, n, dtype=torch.bool, device=rows.device).tril()
    return torch.where(keep[None, :, :, None],
                       torch.exp(sources.unsqueeze(1) - rows.unsqueeze(2)), 0.0)


def _carried_back(ends: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The backward's transpose of :func:`_causal_weights`: ``w[:, i, j] = exp(ends[:, i] -
    columns[:, j])`` for the later chunks ``j > i`` and the final state (the last column, every
    ``i``), else 0: ``ends [B H, NC, K]``, ``columns [B H, NC + 1, K]`` -> ``[B H, NC, NC + 1,
    K]``."""
    nc = ends.shape[1]
    keep = torch.ones(nc, nc + 1, dtype=torch.bool, device=ends.device).triu(1)
    keep[:, -1] = True
    return torch.where(keep[None, :, :, None],
                       torch.exp(ends.unsqueeze(2) - columns.unsqueeze(1)), 0.0)


def _weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[:, i, s] = sum_j weights[:, i, j, s] values[:, j, s]``: ``weights [B H, I, J, K]``,
    ``values [B H, J, K, d]`` -> ``[B H, I, K, d]`` (one batched product per slot)."""
    return torch.matmul(weights.permute(0, 3, 1, 2), values.transpose(1, 2)).transpose(1, 2)


def _prepare(logits: torch.Tensor, v: torch.Tensor, state: ScanState, step: int,
             width: float) -> _ScanCache | None:
    """The scan's per-chunk factors (no autograd), or ``None`` if some chunk needs bands."""
    b, h, t, k = logits.shape
    d = v.shape[-1]
    nc = -(-t // step)
    n = b * h * nc
    lg = _chunks(logits, nc, step, float("-inf")).view(b * h, nc, step, k)
    m0 = state.m.reshape(b * h, 1, k)
    # each chunk's reference: the running max at its end, a running max of the chunk maxima
    ends = torch.cat([m0, lg.amax(dim=2)], dim=1).cummax(dim=1).values  # [B H, NC + 1, K]
    m_prev, ends = ends[:, :-1], ends[:, 1:]
    # One band per chunk unless the running max rises by the band width inside a chunk: its
    # lowest value, at the chunk's first written position, is at least the previous chunk's
    # end, or (where nothing was written before) the chunk's smallest written logit; only if
    # that bound fails, the running max itself decides.
    low = torch.where(m_prev > float("-inf"), m_prev,
                      lg.masked_fill(lg == float("-inf"), float("inf")).amin(dim=2))
    if bool((ends - low >= width).any()):
        mu = torch.maximum(m0, lg.view(b * h, nc * step, k).cummax(dim=1).values)
        mu = mu.view(lg.shape)  # running max, -inf before a slot's first write
        if bool(((ends.unsqueeze(2) - mu >= width) & (mu > float("-inf"))).any()):
            return None
    c = torch.where(ends > float("-inf"), ends, 0.0)
    cache = _ScanCache()
    cache.pending = []
    cache.shape, cache.step = (b, h, t, nc), step
    ei = lg.new_empty(b * h, nc, step + k, k)
    torch.exp(lg - c.unsqueeze(2), out=ei[:, :, :step])
    ei[:, :, step:] = torch.eye(k, dtype=ei.dtype, device=ei.device)
    cache.ei = ei.view(n, step + k, k)
    vn = v.new_empty(b, h, nc, step + k, d)
    if nc * step == t:
        vn[:, :, :, :step] = v.view(b, h, nc, step, d)
    else:
        vn[:, :, :, :step] = _chunks(v, nc, step).view(b, h, nc, step, d)
    cache.vn = vn.view(n, step + k, d)
    e3 = cache.e
    ev = torch.bmm(e3.transpose(1, 2), cache.v).view(b * h, nc, k, d)
    esum = ei[:, :, :step].sum(dim=2)  # [B H, NC, K]
    # the state each chunk starts from and the final one, each at its own reference: sums over
    # the initial state (at m0) and the chunks before (chunk j at its end reference), source j
    # weighted exp(ref_j - c_i) <= 1 (the references never fall; 0 before the first write)
    weights = _causal_weights(torch.cat([m0, ends], dim=1), torch.cat([c, c[:, -1:]], dim=1))
    den0, num0 = state.den.reshape(b * h, 1, k), state.num.reshape(b * h, 1, k, d)
    den_all = (weights * torch.cat([den0, esum], dim=1).unsqueeze(1)).sum(dim=2)
    num_all = _weighted_sum(weights, torch.cat([num0, ev], dim=1))  # [B H, NC + 1, K, d]
    vn.view(b * h, nc, step + k, d)[:, :, step:] = num_all[:, :nc]
    den_prev, den, num = den_all[:, :nc], den_all[:, nc], num_all[:, nc]
    denom = ei[:, :, :step].cumsum(dim=2) + den_prev.unsqueeze(2)
    # written (some logit > -inf so far) exactly where denom > 0: with one band per chunk a
    # written position's denominator is at least e^-width, an unwritten one's is 0
    cache.inv = torch.where(denom > 0, denom.reciprocal(), 0.0).view(n, step, k)
    cache.ends, cache.refs = ends, c
    cache.final = ScanState(m=ends[:, -1].view(b, h, k), den=den.view(b, h, k),
                            num=num.view(b, h, k, d))
    return cache


Term = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _backward(cache: _ScanCache, terms: list[Term], dnum: torch.Tensor | None,
              dden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dlogits, dv)`` ``[N, C, *]`` for slot gradients ``G[t, s] = sum coef[t, s] x_t`` over
    ``terms`` ``(x, bc, pdot, xv, p)`` (chunked: ``x``, ``bc = coef inv``,
    ``pdot[t, s] = <x_t, slot_s(t)>``, ``xv = x vn^T`` and ``p = bc ei^T``, both masked) and
    the final state's gradients ``dnum, dden`` (or None)."""
    e, step = cache.e, cache.step
    bh, nc, k = cache.refs.shape
    d = cache.vn.shape[-1]
    dvn = bp = None
    for x, bc, pdot, _, p in terms:
        dvn = (torch.bmm(p.transpose(1, 2), x) if dvn is None  # [N, C + K, d]: intra dv
               else dvn.baddbmm_(p.transpose(1, 2), x))  # over the state's gradient
        bp = bc * pdot if bp is None else bp.addcmul_(bc, pdot)
    if terms:
        local_dnum = dvn.view(bh, nc, step + k, d)[:, :, step:]
        local_dden = bp.sum(dim=1).view(bh, nc, k)  # minus the gradient of den_prev
    dn = dnum.reshape(bh, 1, k, d) if dnum is not None else e.new_zeros(bh, 1, k, d)
    dd = dden.reshape(bh, 1, k) if dden is not None else e.new_zeros(bh, 1, k)
    if not terms:
        local_dnum, local_dden = e.new_zeros(bh, nc, k, d), e.new_zeros(bh, nc, k)
    # the gradient of chunk i's end state: the later chunks' local terms and the final
    # state's gradient carried back, from chunk j (or the end) weighted exp(ends_i - c_j) <= 1
    weights = _carried_back(cache.ends, torch.cat([cache.refs, cache.refs[:, -1:]], dim=1))
    dn3 = _weighted_sum(weights, torch.cat([local_dnum, dn], dim=1)).reshape(-1, k, d)
    dd3 = (weights * torch.cat([-local_dden, dd], dim=1).unsqueeze(1)).sum(dim=2).view(-1, 1, k)
    inner = torch.bmm(cache.v, dn3.transpose(1, 2)).add_(dd3)  # [N, C, K]
    if not terms:
        return inner.mul_(e), torch.bmm(e, dn3)
    for _, bc, _, xv, _ in terms:
        inner.baddbmm_(xv[:, :, :step].transpose(1, 2), bc)
    # sum_{t >= tau} bc[t] pdot[t]: a reversed cumulative sum inside each chunk
    inner.sub_(bp.flip(1).cumsum(dim=1).flip(1))
    dv = torch.baddbmm(dvn[:, :step], e, dn3)
    return inner.mul_(e), dv


class _Prepare(torch.autograd.Function):
    """The scan's factors (into ``holder``) and its differentiable final ``(den, num)``."""

    @staticmethod
    def forward(ctx, logits, v, holder, state, step, width):
        cache = _prepare(logits, v, state, step, width)
        holder.append(cache)
        if cache is None:
            return logits.new_zeros(()), v.new_zeros(())
        ctx.cache = cache
        return cache.final.den.clone(), cache.final.num.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dden, dnum):
        cache = ctx.cache
        dl, dv = _backward(cache, [], dnum, dden)
        return (_unchunk(dl, cache.shape), _unchunk(dv, cache.shape), None, None, None,
                None)


class _Scores(torch.autograd.Function):
    """``<x_t, slot_s(t)>`` ``[B, H, T, K]`` on a prepared scan; ``x [B, H, T, d]``.

    Its backward also takes the logits' and values' gradients of the reads on the same scan
    (:class:`_Read`, which run first: their weights depend on these scores), left in
    ``cache.pending`` by their backward in the same backward pass, so the chunks' state
    gradients are carried back once for all."""

    @staticmethod
    def forward(ctx, x, logits, v, cache):
        x = _chunks(x, cache.shape[3], cache.step)
        xv = torch.bmm(x, cache.vn.transpose(1, 2))
        xv[:, :, :cache.step].tril_()  # causal inside the chunk
        out = torch.bmm(xv, cache.ei).mul_(cache.inv)
        ctx.cache = cache
        ctx.save_for_backward(x, xv, out)
        return _unchunk(out, cache.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, xv, out = ctx.saved_tensors
        cache = ctx.cache
        task = torch._C._current_graph_task_id()
        reads = [term for owner, term in cache.pending if owner == task]
        cache.pending.clear()  # entries of other passes: their logits and values had no use
        bc = _chunks(grad, cache.shape[3], cache.step) * cache.inv
        p = torch.bmm(bc, cache.ei.transpose(1, 2))
        p[:, :, :cache.step].tril_()
        dl, dv = _backward(cache, [(x, bc, out, xv, p), *reads], None, None)
        dx = torch.bmm(p, cache.vn)
        return (_unchunk(dx, cache.shape), _unchunk(dl, cache.shape),
                _unchunk(dv, cache.shape), None)


class _Read(torch.autograd.Function):
    """``sum_s a[t, s] slot_s(t)`` ``[B, H, T, d]`` on a prepared scan; ``a [B, H, T, K]``.

    The gradients of the logits and values are left to :class:`_Scores`'s backward (see
    there); this one returns the weights' ``<grad_t, slot_s(t)>``."""

    @staticmethod
    def forward(ctx, a, logits, v, cache):
        ai = _chunks(a, cache.shape[3], cache.step) * cache.inv
        p = torch.bmm(ai, cache.ei.transpose(1, 2))
        p[:, :, :cache.step].tril_()
        out = torch.bmm(p, cache.vn)
        ctx.cache = cache
        ctx.save_for_backward(ai, p)
        return _unchunk(out, cache.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ai, p = ctx.saved_tensors
        cache = ctx.cache
        grad = _chunks(grad, cache.shape[3], cache.step)
        gv = torch.bmm(grad, cache.vn.transpose(1, 2))
        gv[:, :, :cache.step].tril_()
        da = torch.bmm(gv, cache.ei).mul_(cache.inv)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            cache.pending.append((torch._C._current_graph_task_id(), (grad, ai, da, gv, p)))
        return _unchunk(da, cache.shape), None, None, None


def asa_attend_chunk(
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
    """:func:`~modeling.asm.asm_chunk_autograd.asa_attend_chunk_autograd` (same arguments and
    results) with the hand-written backward of this module; falls back to it where a chunk
    needs more than one band or the initial state needs a gradient."""
    b, h, t, k = logits.shape
    d = v.shape[-1]
    dt = torch.promote_types(logits.dtype, torch.float32)
    if state is not None and any(x.requires_grad for x in (state.m, state.den, state.num)):
        return asa_attend_chunk_autograd(logits, v, q, key_logits, gamma, read_temperature, refine,
                                  chunk_size, state, gate)
    logits, v, q, key_logits = (x.to(dt) for x in (logits, v, q, key_logits))
    if state is None:
        state = ScanState.empty(b, h, k, d, v.device, dt)
    else:
        state = ScanState(m=state.m.to(dt), den=state.den.to(dt), num=state.num.to(dt))
    step = max(1, min(chunk_size, t))
    holder: list[_ScanCache | None] = []
    den, num = _Prepare.apply(logits, v, holder, state, step, band_width(dt))
    cache = holder[0]
    if cache is None:
        return asa_attend_chunk_autograd(logits, v, q, key_logits, gamma, read_temperature, refine,
                                  chunk_size, state, gate)
    final = ScanState(m=cache.final.m, den=den, num=num)
    gamma = torch.as_tensor(gamma, dtype=dt, device=v.device)
    gamma = gamma.view(1, -1, 1, 1) if gamma.dim() == 1 else gamma
    content = _Scores.apply(q, logits, v, cache)
    r = torch.softmax((key_logits + gamma * content) / read_temperature, dim=-1)
    out, delta = read_refined(r, refine, gate, lambda a: _Read.apply(a, logits, v, cache))
    return out, r, delta, final


class _ChunkLinearAttention(torch.autograd.Function):
    """Chunked causal linear attention (see :func:`causal_linear_attention_chunk`); inputs
    ``q, k [N, C, M]``, ``v [N, C, Mv]`` chunked, ``s0 [B H, M, Mv]``, ``z0 [B H, M]``; outputs
    ``out [N, C, Mv]`` and the final ``(S, Z)``."""

    @staticmethod
    def forward(ctx, q, k, v, s0, z0, nc):
        bh, mm, mv = s0.shape
        kv = torch.bmm(k.transpose(1, 2), v).view(bh, nc, mm, mv)
        ks = k.sum(dim=1).view(bh, nc, mm)
        # the state at each chunk's start, and the final one: running sums from (s0, z0)
        s_all = torch.cat((s0.unsqueeze(1), kv), dim=1).cumsum(dim=1)  # [B H, NC + 1, M, Mv]
        z_all = torch.cat((z0.unsqueeze(1), ks), dim=1).cumsum(dim=1)
        s, z = s_all[:, -1], z_all[:, -1]
        sp, zp = s_all[:, :-1].reshape(-1, mm, mv), z_all[:, :-1].reshape(-1, 1, mm)
        a = torch.bmm(q, k.transpose(1, 2)).tril_()  # [N, C, C]
        numer = torch.bmm(q, sp).baddbmm_(a, v)
        denom = (q * zp).sum(-1) + a.sum(-1)  # [N, C]
        inv = safe_reciprocal(denom)
        out = numer.mul_(inv.unsqueeze(-1))
        ctx.save_for_backward(q, k, v, sp, zp, a, inv, out)
        ctx.nc = nc
        return out, s, z

    @staticmethod
    def backward(ctx, grad, ds, dz):
        q, k, v, sp, zp, a, inv, out = ctx.saved_tensors
        nc = ctx.nc
        n, _, mm = q.shape
        mv = v.shape[-1]
        bh = n // nc
        gn = grad * inv.unsqueeze(-1)  # [N, C, Mv]
        gz = (grad * out).sum(-1).mul_(inv).neg_()  # [N, C]: gradient of the normaliser
        da = torch.bmm(gn, v.transpose(1, 2)).add_(gz.unsqueeze(-1)).tril_()
        dq = torch.bmm(gn, sp.transpose(1, 2)).baddbmm_(da, k)
        dq.addcmul_(gz.unsqueeze(-1), zp)
        dsp = torch.bmm(q.transpose(1, 2), gn).view(bh, nc, mm, mv)  # gradient of sp
        dzp = (q * gz.unsqueeze(-1)).sum(1).view(bh, nc, mm)
        # the gradient of each chunk's k^T v and sum k: the later chunks' sp, zp and (S, Z)
        # reversed running sums from the final state's gradient: chunk i's (k^T v, sum k)
        # reaches the later chunks' starts and (S, Z); the first entry is (s0, z0)'s gradient
        ds = ds.reshape(bh, 1, mm, mv) if ds is not None else q.new_zeros(bh, 1, mm, mv)
        dz = dz.reshape(bh, 1, mm) if dz is not None else q.new_zeros(bh, 1, mm)
        ds_all = torch.cat((dsp, ds), dim=1).flip(1).cumsum(dim=1).flip(1)
        dz_all = torch.cat((dzp, dz), dim=1).flip(1).cumsum(dim=1).flip(1)
        acc_s, acc_z = ds_all[:, 0], dz_all[:, 0]
        dkv = ds_all[:, 1:].reshape(-1, mm, mv)
        dks = dz_all[:, 1:].reshape(-1, 1, mm)
        dk = torch.bmm(da.transpose(1, 2), q).baddbmm_(v, dkv.transpose(1, 2)).add_(dks)
        dv = torch.bmm(a.transpose(1, 2), gn).baddbmm_(k, dkv)
        return dq, dk, dv, acc_s, acc_z, None


def causal_linear_attention_chunk(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    chunk_size: int = 64,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~modeling.asm.asm_chunk_autograd.causal_linear_attention_chunk_autograd` (same
    arguments and
    results) as one autograd Function over all chunks at once: per chunk ``C`` positions,
    ``out = (q S_prev + tril(q k^T) v) / (q . Z_prev + rowsum tril(q k^T))``, the chunks'
    starting states ``(S_prev, Z_prev)`` a running sum of the chunks' ``(k^T v, sum k)``
    (a cumulative sum over chunks); the backward carries the states' gradients back the same
    way."""
    b, h, t, mm = phi_q.shape
    mv = v.shape[-1]
    dt = torch.promote_types(phi_q.dtype, torch.float32)
    phi_q, phi_k, v = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    step = max(1, min(chunk_size, t))
    nc = -(-t // step)
    q3, k3, v3 = (_chunks(x, nc, step) for x in (phi_q, phi_k, v))  # [N, C, *]
    if state is None:
        s0 = torch.zeros(b * h, mm, mv, device=v.device, dtype=dt)
        z0 = torch.zeros(b * h, mm, device=v.device, dtype=dt)
    else:
        s0 = state[0].to(dt).reshape(b * h, mm, mv)
        z0 = state[1].to(dt).reshape(b * h, mm)
    out, s, z = _ChunkLinearAttention.apply(q3, k3, v3, s0, z0, nc)
    return _unchunk(out, (b, h, t, nc)), (s.view(b, h, mm, mv), z.view(b, h, mm))
