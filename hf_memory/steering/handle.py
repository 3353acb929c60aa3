"""Steer a stock model's ``generate()`` with memory banks, without touching its code or cache.

``steer(model, banks)`` registers one attention function (and the matching mask function) with
transformers' ``AttentionInterface``, switches the model to it, and hooks the pre-RoPE query at
every layer. Layers or heads without steering call the model's own attention function
unchanged, so empty or inactive steering is bit-identical to the plain model; a layer whose
heads are all steered skips it (and returns no attention weights). Banks live outside
the KV cache: ``update()`` swaps them between any two forward passes.

Steering is a property of a call, not of the model: the active handle travels in a
``contextvars`` variable, so one model object serves steered and plain callers in many threads
(or asyncio tasks) at once, each getting exactly what it would get alone. What is installed on
the shared model (the attention implementation and the hooks) is inert without an active handle;
the first handle on a model installs it and the last one removed takes it away.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin

from hf_memory.banks.bank import MemoryBank
from hf_memory.banks.bank_set import BankSet
from hf_memory.models.adapters import get_adapter
from hf_memory.models.transformers_compat import cache_from_kwargs
from hf_memory.steering.attention import ACTIVE_STEERING, STEERING_IN_USE, SiteState
from hf_memory.steering.call_scope import CallScope
from hf_memory.steering.dispatch import MIXTURE_PATHS
from hf_memory.steering.host import acquire_host, release_host
from hf_memory.steering.mixture import HeadSlots
from hf_memory.steering.site_plan import plan_sites

__all__ = ["RowSteering", "SteeringHandle", "check_strength", "is_per_row", "steer",
           "steered_generate"]

logger = logging.getLogger(__name__)


def check_strength(strength: Any) -> float:
    """The strength dial: a number in [0, 1] (0: the plain model, 1: the full mixture)."""
    if (isinstance(strength, bool) or not isinstance(strength, int | float)
            or not 0.0 <= strength <= 1.0):
        raise ValueError(f"strength must be a number in [0, 1] (0: plain, 1: the full bank "
                         f"mixture), got {strength!r}")
    return float(strength)


class CallSteering(CallScope):
    """What every memory steering of a call shares: activation in a context (see
    :class:`~hf_memory.steering.call_scope.CallScope`), the per-thread pre-RoPE queries of the
    running forward pass, and the model host."""

    variable = ACTIVE_STEERING
    in_use = STEERING_IN_USE

    def _start(self, model: nn.Module, adapter, active: bool) -> None:
        self._queries = threading.local()
        self._host = acquire_host(model, adapter)
        self._begin(active)

    def _groups(self, attention: nn.Module) -> list[tuple[torch.Tensor | None, SiteState]]:
        raise NotImplementedError

    def _capture(self, attention: nn.Module, output: torch.Tensor) -> None:
        if self._groups(attention):
            if not hasattr(self._queries, "by_module"):
                self._queries.by_module = {}
            self._queries.by_module[id(attention)] = self.adapter.query(output, self.model.config)

    def _take_query(self, attention: nn.Module) -> torch.Tensor | None:
        return getattr(self._queries, "by_module", {}).pop(id(attention), None)

    def _stop(self) -> bool:
        """Deactivate and release the model; False if already done."""
        if not self._end():
            return False
        release_host(self._host)
        return True


class SteeringHandle(CallSteering):
    """A steering of one model; a context manager and a removable handle.

    Created active in the calling context (thread / asyncio task) until :meth:`remove`; other
    threads using the same model stay plain. :meth:`applied` steers a block of calls with it in
    any other context (e.g. a worker thread serving a request), ``active=False`` creates it
    without activating it anywhere.

    Args:
        model: a stock ``*ForCausalLM`` of a supported family, attention ``sdpa`` or ``eager``.
        banks: a :class:`BankSet` or a sequence of :class:`MemoryBank` (may be empty).
        selector: a frozen selector artifact (layers, units, unit type, layer gains and its
            calibrated strength); if given, ``layers``, ``units``, ``unit_type`` and
            ``layer_gains`` must be left out.
        layers: layers to steer (default: the keys of a ``units`` mapping, else every layer
            some bank covers).
        units: units to steer, the same at every layer, or a mapping layer → units
            (default: all).
        unit_type: ``"head"`` (query heads) or ``"kv_group"`` (expanded to its query heads).
        layer_gains: ρ_ℓ per layer (default 1.0).
        gamma, size_normalize: override the bank set's mixture settings.
        trace_only: compute and record the routing at the sites but leave the model's outputs
            unchanged (diagnostic tracing for calibration).
        strength: the dial in [0, 1]: each steered head's output is the plain output moved this
            fraction of the way to the bank mixture (0: bit-identical to the plain model, 1: the
            full mixture, the default). Unlike the gain ρ, whose zero still gives the banks
            attention mass, its zero removes them. :meth:`set_strength` turns it later. With a
            selector, the dial scales the selector's own calibrated strength (1: as calibrated).
        mixture_path: ``"auto"`` (default) merges the banks into the model's own attention
            kernel's output through its log-sum-exp where such a kernel exists for the device
            and dtype (:mod:`hf_memory.steering.stock_attention`: CPU, and CUDA in float32 and
            half precision; SDPA models without soft-caps or sinks), on CUDA in one Triton
            kernel where Triton is installed (:mod:`hf_memory.steering.fused_merge`);
            ``"torch"`` the same merge in PyTorch ops only; ``"reference"`` always recomputes
            the history's scores beside it in the compute dtype
            (:func:`hf_memory.steering.mixture.bank_mixture`). All give the same mixture up
            to rounding.
        active: activate the steering in the calling context now (default).
    """

    def __init__(
        self,
        model: nn.Module,
        banks: BankSet | Sequence[MemoryBank],
        *,
        selector: Any = None,
        layers: Sequence[int] | None = None,
        units: Sequence[int] | Mapping[int, Sequence[int]] | None = None,
        unit_type: str = "head",
        layer_gains: Mapping[int, float] | None = None,
        gamma: float | None = None,
        size_normalize: bool | None = None,
        trace_only: bool = False,
        strength: float = 1.0,
        mixture_path: str = "auto",
        active: bool = True,
    ) -> None:
        if mixture_path not in MIXTURE_PATHS:
            raise ValueError(f"mixture_path must be one of {MIXTURE_PATHS}, got {mixture_path!r}")
        self.model = model
        self._mixture_path = mixture_path
        self.strength = check_strength(strength)
        self._calibrated_strength = 1.0 if selector is None else check_strength(
            getattr(selector, "strength", 1.0))
        self.adapter = get_adapter(model)
        config = model.config
        self._heads, self._kv_heads = config.num_attention_heads, config.num_key_value_heads
        if selector is not None:
            if layers is not None or units is not None or layer_gains is not None:
                raise ValueError("give a selector or layers/units/layer_gains, not both")
            selector.check_model(model)
            layers, units = selector.layers, selector.units
            unit_type, layer_gains = selector.unit_type, selector.layer_gains
        self._requested = (layers, units, unit_type, dict(layer_gains or {}))
        self._overrides = (gamma, size_normalize)
        self._trace_only = trace_only
        self._record_routing = False
        self._routing_per_slot = False
        self._sites: dict[int, SiteState] = {}
        self._by_module: dict[int, SiteState] = {}  # by id(): torch.compile traces int keys
        self.audit_log: list[dict[str, Any]] = []
        self._install(self._as_bank_set(banks))
        self._start(model, self.adapter, active)
        self._record("activate")

    def _as_bank_set(self, banks: BankSet | Sequence[MemoryBank]) -> BankSet:
        bank_set = banks if isinstance(banks, BankSet) else BankSet(list(banks))
        bank_set.check_model(self.model)
        return bank_set

    def _install(self, bank_set: BankSet) -> None:
        """Plan the sites of ``bank_set`` and publish them in one assignment (a call running in
        another thread sees the old sites or the new ones, never a mixture)."""
        layers, units, unit_type, gains = self._requested
        gamma, normalize = self._overrides
        parameter = next(self.model.parameters())
        plans = plan_sites(
            bank_set, config=self.model.config,
            rotary=functools.partial(self.adapter.rotary, self.model),
            device=parameter.device, dtype=torch.promote_types(parameter.dtype, torch.float32),
            layers=layers, units=units, unit_type=unit_type, layer_gains=gains, gamma=gamma,
            size_normalize=normalize)
        sites = {layer: self._site_state(plan, parameter.device, bank_set.sink_reads_banks)
                 for layer, plan in plans.items()}
        self.bank_set, self.sites = bank_set, {layer: plan.heads for layer, plan in plans.items()}
        self._bank_audit = bank_set.audit()  # hashed once: audit records reuse it
        self._publish(sites)

    def _site_state(self, plan, device: torch.device, sink_reads_banks: bool) -> SiteState:
        heads = torch.tensor(plan.heads, device=device, dtype=torch.long)
        kv_index = head_slots = minus_slots = None
        if plan.stack is not None:
            kv_index = heads // (self._heads // plan.stack.keys.shape[0])
            head_slots = HeadSlots.of(plan.stack, kv_index)
            if plan.minus is not None:
                minus_slots = HeadSlots.of(plan.minus, kv_index)
        return SiteState(
            heads=heads, stack=plan.stack, all_heads=len(plan.heads) == self._heads,
            gamma=plan.gamma, size_normalize=plan.size_normalize,
            record_routing=self._record_routing, routing_per_slot=self._routing_per_slot,
            trace_only=self._trace_only,
            strength=self._site_strength, path=self._mixture_path, kv_index=kv_index,
            head_slots=head_slots, minus=plan.minus, minus_slots=minus_slots,
            sink_reads_banks=sink_reads_banks)

    @property
    def _site_strength(self) -> float:
        """The strength every site runs at: the dial times the selector's calibrated one."""
        return self.strength * self._calibrated_strength

    def _publish(self, sites: dict[int, SiteState]) -> None:
        by_module = {id(self.adapter.attention(self.model, layer)): site
                     for layer, site in sites.items()}
        self._sites, self._by_module = sites, by_module

    # -- called by the installed hooks and the attention function, in the running call

    def _site(self, attention: nn.Module) -> SiteState | None:
        """The site at ``attention`` when a bank applies there (None: the layer runs plain)."""
        site = None if self._removed else self._by_module.get(id(attention))
        if site is None or site.stack is None or site.strength == 0.0:
            return None
        return site

    def _groups(self, attention: nn.Module) -> list[tuple[torch.Tensor | None, SiteState]]:
        """(rows, site) pairs steered at ``attention``; rows None: the whole batch."""
        site = self._site(attention)
        return [] if site is None else [(None, site)]

    # -- the public handle

    def update(self, banks: BankSet | Sequence[MemoryBank]) -> None:
        """Swap the banks between two forward passes; the KV cache is not touched."""
        if self._removed:
            raise RuntimeError("this steering handle was removed")
        self._install(self._as_bank_set(banks))
        self._record("update")

    def set_strength(self, strength: float) -> None:
        """Turn the dial (see ``strength``) between two forward passes."""
        if self._removed:
            raise RuntimeError("this steering handle was removed")
        self.strength = check_strength(strength)
        self._publish({layer: replace(site, strength=self._site_strength)
                       for layer, site in self._sites.items()})
        self._record("strength", strength=self.strength)

    def remove(self) -> None:
        """End this steering; when it is the model's last, restore the model exactly (attention
        implementation and hooks). Safe from any thread; a second call does nothing."""
        if self._stop():
            self._record("remove")

    @property
    def active_sites(self) -> dict[int, list[int]]:
        """Steered layers → query heads, for layers where at least one bank applies."""
        return {layer: heads for layer, heads in self.sites.items()
                if self._sites[layer].stack is not None}

    def record_routing(self, enabled: bool = True, *, per_slot: bool = False) -> None:
        """Keep the routing mass π of every steered forward pass (see :meth:`routing`), per
        bank or (``per_slot``) per slot.

        The setting survives :meth:`update`; turning it on (again) clears what was recorded.
        """
        self._record_routing, self._routing_per_slot = enabled, per_slot
        for site in self._sites.values():
            site.record_routing, site.routing_per_slot = enabled, per_slot
            site.routing.clear()

    def routing(self, *, clear: bool = False) -> dict[int, list[torch.Tensor]]:
        """Recorded routing masses per layer: ``[B, H_sel, T, 1 + n_banks]`` per forward pass.

        Column 0 is the prompt bank, column 1 + i the i-th bank of the bank set; recorded
        ``per_slot``, ``[B, H_sel, T, 1 + M]``: column 1 + j the j-th slot of the layer's banks
        (the bank set's banks in order, their slots concatenated).
        """
        recorded = {layer: list(site.routing) for layer, site in self._sites.items()}
        if clear:
            for site in self._sites.values():
                site.routing.clear()
        return recorded

    def _on_forward(self, args, kwargs) -> None:
        cache = cache_from_kwargs(kwargs)
        if cache is None or cache.get_seq_length() == 0:
            ids = kwargs.get("input_ids", args[0] if args else None)
            shape = tuple(ids.shape) if ids is not None else None
            self._record("forward from an empty cache", input_shape=shape)

    @torch.compiler.disable  # bookkeeping outside any traced graph
    def _record(self, event: str, **extra: Any) -> None:
        record = {
            "time": time.time(),
            "event": event,
            "banks": self._bank_audit,
            "sites": {str(k): v for k, v in self.active_sites.items()} if self._sites else {},
            "strength": self.strength,
            **extra,
        }
        self.audit_log.append(record)
        logger.info("memory inception %s: banks=%s sites=%s", event,
                    [(b["name"], b["role"], b["content_hash"][:12]) for b in record["banks"]],
                    record["sites"])


RowBanks = BankSet | Sequence[MemoryBank] | SteeringHandle | None


def is_per_row(banks: Any) -> bool:
    """Whether ``banks`` gives one bank set (or None) per batch row rather than one bank set."""
    if isinstance(banks, BankSet | MemoryBank | str) or not isinstance(banks, Sequence):
        return False
    per_row = [item is None or isinstance(item, BankSet | list | tuple | SteeringHandle)
               for item in banks]
    if any(per_row) and not all(per_row):
        raise ValueError("banks must be one bank set (MemoryBank items) or one bank set or None "
                         "per batch row, not a mixture of both")
    return bool(per_row) and all(per_row)


class RowSteering(CallSteering):
    """Per-row banks in one batch: row ``i`` is steered by ``rows[i]`` (None: plain), exactly
    as it would be alone under its own bank set; plain rows are bit-identical to the plain
    model's. One inactive :class:`SteeringHandle` per distinct bank set holds the sites; this
    object is what the running call activates. Every forward must have ``len(rows)`` rows.

    A row may also be an inactive handle (``steer(model, banks, selector=..., active=False)``),
    so rows can differ in sites and gains too (several directions, each with its own selector,
    in one batch); such handles stay the caller's and outlive this object. Keyword arguments
    (selector, layers, units, ...) apply to the rows given as bank sets; routing traces
    (``trace_only``, :meth:`SteeringHandle.record_routing`) need one bank set and are refused.
    """

    def __init__(self, model: nn.Module, rows: Sequence[RowBanks], *, active: bool = True,
                 **steering: Any) -> None:
        if steering.get("trace_only"):
            raise ValueError("per-row banks record no routing trace: steer one bank set to trace")
        self.model, self.rows = model, list(rows)
        self.adapter = get_adapter(model)
        self.audit_log: list[dict[str, Any]] = []
        members: dict[int, tuple[SteeringHandle, list[int]]] = {}
        self._owned: list[SteeringHandle] = []  # built here from bank sets; removed with us
        try:
            for i, banks in enumerate(self.rows):
                if banks is None:
                    continue
                if id(banks) not in members:
                    members[id(banks)] = (self._row_handle(i, banks, steering), [])
                members[id(banks)][1].append(i)
        except BaseException:
            for handle in self._owned:
                handle.remove()
            raise
        device = next(model.parameters()).device
        self._members = [(handle, torch.tensor(indices, device=device))
                         for handle, indices in members.values()]
        self._row_handles = [None if banks is None else members[id(banks)][0]
                             for banks in self.rows]
        self._start(model, self.adapter, active)  # also for an all-plain batch
        self._record("activate")

    def _row_handle(self, row: int, banks: Any, steering: dict[str, Any]) -> SteeringHandle:
        if isinstance(banks, SteeringHandle):
            if banks.model is not self.model or banks._removed:
                raise ValueError(f"batch row {row}: its steering handle is removed or steers "
                                 "another model")
            return banks
        try:
            handle = SteeringHandle(self.model, banks, active=False, **steering)
        except ValueError as error:
            raise ValueError(f"banks of batch row {row}: {error}") from None
        self._owned.append(handle)
        return handle

    def _groups(self, attention: nn.Module) -> list[tuple[torch.Tensor | None, SiteState]]:
        if self._removed:
            return []
        return [(rows, site) for handle, rows in self._members
                if (site := handle._site(attention)) is not None]

    def _on_forward(self, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is not None and ids.shape[0] != len(self.rows):
            raise ValueError(f"per-row banks: {len(self.rows)} bank sets (or None) for a batch "
                             f"of {ids.shape[0]} rows; give one per row")
        if any(handle._removed for handle, _ in self._members):
            raise RuntimeError("a row's steering handle was removed while its batch is steered")
        cache = cache_from_kwargs(kwargs)
        if cache is None or cache.get_seq_length() == 0:
            self._record("forward from an empty cache",
                         input_shape=None if ids is None else tuple(ids.shape))

    @torch.compiler.disable  # bookkeeping outside any traced graph
    def _record(self, event: str, **extra: Any) -> None:
        record = {"time": time.time(), "event": event,
                  "rows": [None if handle is None else handle.bank_set.audit()
                           for handle in self._row_handles], **extra}
        self.audit_log.append(record)
        logger.info("memory inception %s with per-row banks: %d rows, %d bank sets", event,
                    len(self.rows), len(self._members))

    def remove(self) -> None:
        """End the steering of every row (see :meth:`SteeringHandle.remove`)."""
        if self._stop():
            for handle in self._owned:
                handle.remove()
            self._record("remove")


def steer(model: nn.Module, banks: BankSet | Sequence[MemoryBank] | Sequence[RowBanks],
          **kwargs: Any) -> SteeringHandle | RowSteering:
    """Steer ``model`` with ``banks``: ``with steer(model, banks): model.generate(...)``.

    Also usable as a handle (``h = steer(...); ...; h.remove()``). Only the calling thread (or
    asyncio task) is steered; see :class:`SteeringHandle`. ``banks`` may also give one bank set
    (or None: plain) per batch row: see :class:`RowSteering`.
    """
    if is_per_row(banks):
        return RowSteering(model, banks, **kwargs)
    return SteeringHandle(model, banks, **kwargs)


def steered_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    banks: BankSet | Sequence[MemoryBank] | None = None,
    steering: Mapping[str, Any] | None = None,
    **model_kwargs: Any,
):
    """A ``custom_generate`` decoding loop: ``model.generate(**inputs,
    custom_generate=steered_generate, banks=banks, steering={"layers": [...]})``; ``banks``
    may hold one bank set (or None) per batch row.

    Runs the stock greedy / sampling loop under :func:`steer`; the model is restored after.
    """
    if banks is None:
        raise ValueError("steered_generate needs banks=...")
    with steer(model, banks, **dict(steering or {})):  # one bank set, or one per row
        return GenerationMixin._sample(
            model, input_ids, logits_processor=logits_processor,
            stopping_criteria=stopping_criteria, generation_config=generation_config,
            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
