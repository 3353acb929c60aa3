"""The steered attention function registered with transformers, and what each site carries.

``hf_memory_sdpa`` / ``hf_memory_eager`` wrap the stock ``sdpa`` / ``eager`` attention. At a
layer where the running call's steering (:data:`ACTIVE_STEERING`) has a site, the banks join the
history in one softmax: merged into the stock kernel's output by its log-sum-exp
(:mod:`hf_memory.steering.stock_attention`; on CUDA in one Triton kernel,
:mod:`hf_memory.steering.fused_merge`) where that kernel applies, else by recomputing the
history beside it (:func:`~hf_memory.steering.mixture.bank_mixture`, the reference): the form
:mod:`hf_memory.steering.dispatch` picks per site. A contrast
site (:attr:`~hf_memory.banks.bank_set.BankSet.contrast`) computes both mixtures from the same
history and writes o_h + s·(o_{h,target} − o_{h,reference}). Layers and heads without a site call
the stock function unchanged. Where the bank set keeps the first token off the banks, its query
keeps the stock output at every site (:mod:`hf_memory.steering.sink`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_memory.steering.call_scope import InUse
from hf_memory.steering.dispatch import REFERENCE, implementation, resolve_form
from hf_memory.steering.mixture import (
    BankStack,
    HeadSlots,
    bank_mixture,
    toward,
    visible_keys,
)
from hf_memory.steering.rotary import pre_rope_query
from hf_memory.steering.sink import keep_sink_plain
from hf_memory.steering.stock_attention import attention_with_lse

__all__ = ["ACTIVE_STEERING", "BASE_IMPLEMENTATIONS", "IMPL_PREFIX", "ROTARY_KWARG",
           "STEERING_IN_USE", "STEERING_KWARG", "SiteState", "running_steering"]

BASE_IMPLEMENTATIONS = ("sdpa", "eager")
IMPL_PREFIX = "hf_memory_"
# Keyword arguments the model host adds to a steered call, which transformers hands down to the
# attention function: the call's steering (found once per forward pass, not per layer) and the
# layer's rotary (cos, sin), from which a traced call recovers the pre-RoPE query.
STEERING_KWARG = "hf_memory_steering"
ROTARY_KWARG = "hf_memory_rotary"
_NOT_PASSED = object()


@dataclass
class SiteState:
    """What one steered attention layer needs at call time."""

    heads: torch.Tensor
    stack: BankStack | None
    gamma: float
    size_normalize: bool
    all_heads: bool = False
    routing: list[torch.Tensor] = field(default_factory=list)
    record_routing: bool = False
    routing_per_slot: bool = False  # the recorded routing per slot column, not per bank
    trace_only: bool = False
    strength: float = 1.0
    path: str = "auto"
    kv_index: torch.Tensor | None = None  # [Hs] the KV head of each of ``heads``
    head_slots: HeadSlots | None = None  # the stack gathered for ``heads`` (log-sum-exp path)
    minus: BankStack | None = None  # a contrast site's reference bank (subtracted)
    minus_slots: HeadSlots | None = None
    sink_reads_banks: bool = True  # False: a query that sees only itself keeps the stock output


# The steering of the running call (None: plain). Each thread starts with none; asyncio tasks and
# contextvars.copy_context() carry the one of the context that started them.
# (its value: a hf_memory.steering.handle.CallSteering)
ACTIVE_STEERING: ContextVar[Any] = ContextVar("hf_memory_steering", default=None)
STEERING_IN_USE = InUse()  # live activations of memory steerings, any context


def running_steering() -> Any:
    """The running call's memory steering, or None; no context lookup while no steering is
    live anywhere (what keeps a plain call through a model with steering installed traceable
    by ``torch.compile``)."""
    if not STEERING_IN_USE.any:
        return None
    handle = ACTIVE_STEERING.get()
    return handle if handle is not None and handle.live else None


def _base_attention(name: str, module: nn.Module):
    """The stock attention function: registered (``sdpa``) or the modeling file's ``eager``."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _write_steered(output: torch.Tensor, mixed: torch.Tensor, site: SiteState,
                   against: torch.Tensor | None = None) -> None:
    """Put the site's heads of ``mixed`` ``[B, H, T, D]`` into ``output`` ``[B, T, H, D]``: the
    mixture, or at strength s < 1 the plain output moved the fraction s of the way to it; with
    ``against`` (a contrast site's reference mixture) the plain output plus s·(mixed − against)."""
    steered = mixed[:, site.heads]
    if against is not None:
        plain = output[:, :, site.heads].transpose(1, 2)
        steered = plain.to(steered.dtype) + site.strength * (steered - against[:, site.heads])
    elif site.strength != 1.0:  # (the plain heads are only gathered when they are needed)
        steered = toward(output[:, :, site.heads].transpose(1, 2), steered, site.strength)
    output[:, :, site.heads] = steered.transpose(1, 2).to(output.dtype)


def _form(site: SiteState, base_name: str, query: torch.Tensor, dropout: float,
          kwargs: Mapping[str, Any]) -> str:
    """The mixture form at ``site`` for this call (``"reference"``, ``"lse"`` or ``"fused"``,
    :func:`~hf_memory.steering.dispatch.resolve_form`)."""
    return resolve_form(path=site.path, base=base_name, dropout=dropout,
                        history_scores=site.record_routing or site.trace_only, kwargs=kwargs,
                        query=query, slots=site.head_slots)


def _mixed_by_lse(q_pre, query, key, value, attention_mask, site: SiteState,
                  scaling: float, subset: bool, form: str) -> torch.Tensor:
    """The steered output ``[B, T, Hs, D]`` (the model's dtype) of the site's query heads (all
    heads unless ``subset``) from the stock kernel's attention over the history and its
    log-sum-exp (no copy of the cache in float32: only the bank slots are scored), merged by
    ``form`` (``LSE`` or ``FUSED``)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal_skip = attention_mask is None and q_len in (1, kv_len)
    visible = None if causal_skip else visible_keys(attention_mask, q_len, kv_len, query.device)
    if subset:
        q_pre, query = q_pre[:, site.heads], query[:, site.heads]
        if visible is not None and visible.shape[1] != 1:
            visible = visible[:, site.heads]
    history, lse = attention_with_lse(query, key, value, visible, scaling=scaling,
                                      kv_index=site.kv_index if subset else None)
    dtype = site.head_slots.keys_t.dtype
    if not site.size_normalize:
        log_count = 0.0
    elif visible is None and q_len == 1:  # a decoded token sees the whole history
        log_count = math.log(kv_len)
    elif visible is None:  # causal: row i of a prefill sees i + 1 keys
        log_count = torch.arange(kv_len - q_len + 1, kv_len + 1, device=query.device,
                                 dtype=dtype).log_()
    else:
        log_count = visible.sum(-1).clamp_(min=1).to(dtype).log_()
    common = dict(scaling=scaling, log_count=log_count, gamma=site.gamma,
                  size_normalize=site.size_normalize)
    merge = implementation(form)
    if site.minus_slots is None:
        return merge(history, lse, q_pre, query, site.head_slots, strength=site.strength,
                     out_dtype=query.dtype, **common)
    plus, minus = (merge(history, lse, q_pre, query, slots, **common)
                   for slots in (site.head_slots, site.minus_slots))
    steered = history.transpose(1, 2).to(dtype) + site.strength * (plus - minus)
    return steered.to(query.dtype)


def _mixtures(q_pre, query, key, value, visible, site: SiteState, scaling: float,
              kwargs: Mapping[str, Any]):
    """The reference path's mixture at ``site`` (recomputing the history), a contrast site's
    reference mixture (else None) and the routing (when recorded: the target's)."""
    def mixture(stack: BankStack, with_routing: bool):
        return bank_mixture(q_pre, query, key, value, visible, stack, scaling=scaling,
                            gamma=site.gamma, size_normalize=site.size_normalize,
                            with_routing=with_routing, softcap=kwargs.get("softcap"),
                            per_slot=site.routing_per_slot)

    mixed, routing = mixture(site.stack, site.record_routing)
    against = None if site.minus is None else mixture(site.minus, False)[0]
    return mixed, against, routing


def _steered_attention(base_name: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
        output, weights, groups = steered(module, query, key, value, attention_mask,
                                          scaling=scaling, dropout=dropout, **kwargs)
        shielded = [rows for rows, site in groups if not site.sink_reads_banks
                    and not site.trace_only]
        if shielded:  # the stock function sees none of the steering's own keyword arguments
            stock = {k: v for k, v in kwargs.items() if k not in (STEERING_KWARG, ROTARY_KWARG)}
            keep_sink_plain(output, shielded, _base_attention(base_name, module), module, query,
                            key, value, attention_mask,
                            scaling=module.scaling if scaling is None else scaling, **stock)
        return output, weights

    def steered(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                **kwargs):
        """The stock or steered attention output, its weights and the (rows, site) groups."""
        base = _base_attention(base_name, module)
        handle = kwargs.pop(STEERING_KWARG, _NOT_PASSED)
        rotary = kwargs.pop(ROTARY_KWARG, None)
        if handle is _NOT_PASSED:  # called without the model host's pre-hook
            handle = running_steering()
        groups = () if handle is None else handle._groups(module)
        if not groups:
            return (*base(module, query, key, value, attention_mask, scaling=scaling,
                          dropout=dropout, **kwargs), [])
        # eager: the query hook's capture; traced by torch.compile (where the hook does not
        # capture): recovered from the post-RoPE query
        q_pre = None if torch.compiler.is_compiling() else handle._take_query(module)
        if q_pre is None and rotary is not None:
            q_pre = pre_rope_query(query, *rotary)
        if q_pre is None:
            raise RuntimeError("steered attention ran without its pre-RoPE query (no query "
                               "hook capture and no rotary embedding passed to the layer)")
        scaling = module.scaling if scaling is None else scaling
        (rows, site), *others = groups
        forms = [_form(site, base_name, query, dropout, kwargs) for _, site in groups]
        if REFERENCE not in forms:  # every site merges into the stock kernel's output
            if rows is None and not others and site.all_heads:  # one call, no stock call
                return _mixed_by_lse(q_pre, query, key, value, attention_mask, site, scaling,
                                     subset=False, form=forms[0]), None, groups
            output, weights = base(module, query, key, value, attention_mask, scaling=scaling,
                                   dropout=dropout, **kwargs)
            for (rows, site), form in zip(groups, forms, strict=True):
                part = slice(None) if rows is None else rows
                mask = (attention_mask if attention_mask is None or attention_mask.shape[0] == 1
                        else attention_mask[part])
                steered = output[part]
                steered[:, :, site.heads] = _mixed_by_lse(
                    q_pre[part], query[part], key[part], value[part], mask, site, scaling,
                    subset=True, form=form).to(output.dtype)
                output[part] = steered
            return output, weights, groups
        visible = visible_keys(attention_mask, query.shape[2], key.shape[2], query.device)
        if rows is not None or others:  # per-row banks: each group of rows under its own
            output, weights = base(module, query, key, value, attention_mask, scaling=scaling,
                                   dropout=dropout, **kwargs)
            for rows, site in groups:
                seen = visible if visible is None or visible.shape[0] == 1 else visible[rows]
                mixed, against, _ = _mixtures(q_pre[rows], query[rows], key[rows],
                                              value[rows], seen, site, scaling, kwargs)
                part = output[rows]
                _write_steered(part, mixed, site, against)
                output[rows] = part
            return output, weights, groups
        mixed, against, routing = _mixtures(q_pre, query, key, value, visible, site, scaling,
                                            kwargs)
        if site.record_routing:
            site.routing.append(routing[:, site.heads].detach())
        if site.trace_only:
            return (*base(module, query, key, value, attention_mask, scaling=scaling,
                          dropout=dropout, **kwargs), groups)
        if site.all_heads and site.strength == 1.0 and against is None:
            return mixed.transpose(1, 2).to(query.dtype), None, groups
        output, weights = base(module, query, key, value, attention_mask, scaling=scaling,
                               dropout=dropout, **kwargs)
        _write_steered(output, mixed, site, against)
        return output, weights, groups

    return attention


for _base in BASE_IMPLEMENTATIONS:
    AttentionInterface.register(IMPL_PREFIX + _base, _steered_attention(_base))
    AttentionMaskInterface.register(IMPL_PREFIX + _base, ALL_MASK_ATTENTION_FUNCTIONS[_base])
