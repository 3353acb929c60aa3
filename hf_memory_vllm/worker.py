"""The steered attention inside a vLLM worker: memory banks added to stock attention layers.

Each worker holds one :class:`WorkerSteering` for its model. At the attention layers some
servable steering steers (a registered bank set with its own or a registered selector) it hooks
two places of vLLM's own modules (their code unchanged):

- the query projection (``qkv_proj`` for Llama/Qwen2, ``q_norm`` for Qwen3): a copy of the
  pre-RoPE query of the steered tokens (vLLM's rotary embedding rotates in place);
- the attention layer's output: the steered requests' keys are also written to a *shadow
  cache* indexed by vLLM's own slot mapping (so their history can be read back whatever the
  attention backend's cache layout), and for every steered request the rows of its tokens at
  its steered heads are replaced by the mixture's ``"paged"`` form
  (:mod:`hf_memory.steering.dispatch`, :func:`hf_memory.steering.mixture.bank_mixture_over`):
  vLLM's own attention output over the request's history, merged with its banks by one softmax
  over the history's scores and the slot logits — the mixture ``steer()`` computes in
  transformers with :func:`hf_memory.steering.mixture.bank_mixture`, on the same bank tensors
  (:func:`hf_memory.steering.site_plan.plan_sites`), without reading the history's values again.

Bookkeeping is made once per forward pass (:class:`_Step`): decoding requests at the same sites
are one group whose history is gathered as cache blocks (whole, or as far as the rows reach
where each reads one block), read off vLLM's block table, in one indexing op, so a steered layer
costs a fixed handful of ops whatever the number of requests.

Which request steers with what comes from :mod:`hf_memory_vllm.requests`, the logits processor
that sees every request's ``extra_args`` as it joins the batch. Requests without steering, and
layers no steered request uses, run vLLM's attention untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_memory import BankSet, Selector
from hf_memory.models.adapters import SUPPORTED_MODEL_TYPES, UnsupportedModelError
from hf_memory.models.fingerprint import (
    FingerprintMismatchError,
    compare_fingerprints,
    fingerprint_of,
    weights_digest,
)
from hf_memory.steering.dispatch import MixtureInputs, choose_form, implementation
from hf_memory.steering.mixture import BankStack, history_bias
from hf_memory.steering.site_plan import SitePlan, plan_sites

from .registry import FINGERPRINT_IGNORES, Registry, SteeringRequest, bank_set_size

__all__ = ["BATCH", "WorkerSteering"]

logger = logging.getLogger(__name__)
# the mixture's form in a vLLM worker, by the one dispatcher (bank_mixture_over)
MIXTURE = implementation(choose_form(MixtureInputs(host="vllm")))

# model_type → the module whose output is the pre-RoPE query ("qkv_proj": its query columns);
# the architectures served steered by vLLM, a subset of those steer() supports
QUERY_SOURCES = {"llama": "qkv_proj", "qwen2": "qkv_proj", "qwen3": "q_norm",
                 "qwen3_moe": "q_norm", "granite": "qkv_proj", "phi3": "qkv_proj",
                 "mistral": "qkv_proj", "mixtral": "qkv_proj", "gemma2": "qkv_proj",
                 "gemma3_text": "q_norm"}
assert set(QUERY_SOURCES) <= set(SUPPORTED_MODEL_TYPES)

# persistent-batch index → steering, kept by the logits processor of this worker
BATCH: dict[int, SteeringRequest] = {}
# where a group's rows each read one cache block, the positions scored grow in steps of this
# (a divisor of every block size vLLM uses), not the whole block (on the CPU, 32 requests of
# 30-94 tokens in 128-token blocks: the hooks' time 16 % less)
WIDTH_STEP = 16


@dataclass
class _Site:
    """A plan at one layer, on this worker's shard of heads (``heads``: an index tensor, or
    ``slice(None)`` when every head of the shard steers)."""

    heads: torch.Tensor | slice
    stack: BankStack
    gamma: float
    size_normalize: bool
    strength: float = 1.0
    sink_reads_banks: bool = True  # False: a sequence's first token keeps the stock output


def _index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Token rows as an index: a slice (views, no copies) when they are consecutive."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _rows_view(x: torch.Tensor, rows: slice | torch.Tensor, kv_heads: int,
               head_dim: int) -> torch.Tensor | None:
    """The token rows ``x[rows]`` of ``x`` ``[T, KVH·G·D]`` as ``[KVH, n, G, D]`` in one strided
    view (a decoding step's hooks cost more by their count of torch ops than by their work), or None
    where no view can be: rows not consecutive, or a row's elements not adjacent."""
    if not isinstance(rows, slice) or x.dim() != 2 or x.stride(1) != 1:
        return None
    g = x.shape[1] // (kv_heads * head_dim)
    return x.as_strided((kv_heads, rows.stop - rows.start, g, head_dim),
                        (g * head_dim, x.stride(0), head_dim, 1),
                        x.storage_offset() + rows.start * x.stride(0))


@dataclass
class _Group:
    """Steered requests of the forward pass in progress that share their sites: every decoding
    request of one steering (one token each), or one request in prefill.

    ``rows``: their token rows (decoding: one per request; prefill: the request's T);
    ``lengths``: history lengths, the new tokens included; ``table``: their rows of vLLM's block
    table ``[n, blocks]``."""

    sites: dict[int, _Site]
    rows: list[int]
    lengths: list[int]
    table: torch.Tensor
    block_size: int
    decoding: bool
    device: torch.device
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the banks' compute dtype
    _history: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = _index(self.rows, self.device)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Token rows ``[T, H·D]`` of the pass → this group's rows KV-head major, as
        :func:`~hf_memory.steering.mixture.bank_mixture_over` takes them: ``[KVH, n, G, D]``
        (decoding: each request one query; one strided view when its rows are consecutive) or
        ``[KVH, 1, G·T, D]`` (prefill)."""
        view = _rows_view(x, self.index, self.kv_heads, self.head_dim) if self.decoding else None
        if view is not None:
            return view
        rows = x[self.index].view(len(self.rows), self.kv_heads, -1, self.head_dim)
        if self.decoding:
            return rows.transpose(0, 1)
        return rows.permute(1, 2, 0, 3).reshape(self.kv_heads, 1, -1, self.head_dim)

    def put(self, out: torch.Tensor, heads: slice | torch.Tensor, mixed: torch.Tensor) -> None:
        """Write the ``heads`` of ``mixed`` (laid out as :meth:`queries` makes them) into this
        group's rows of ``out`` ``[T, H·D]`` (cast to its dtype by the copy)."""
        n, d = len(self.rows), self.head_dim
        if self.decoding and isinstance(heads, slice):
            view = _rows_view(out, self.index, self.kv_heads, d)
            if view is not None:  # every head of consecutive rows: written through the view
                view.copy_(mixed)
                return
        if self.decoding:
            steered = mixed.transpose(0, 1).reshape(n, -1, d)  # [n, H, D]
        else:
            steered = mixed.view(self.kv_heads, -1, n, d).permute(2, 0, 1, 3).reshape(n, -1, d)
        rows = out.view(out.shape[0], -1, d)
        if isinstance(heads, slice):
            rows[self.index] = steered
        elif isinstance(self.index, slice):
            rows[self.index, heads] = steered[:, heads]
        else:
            rows[self.index[:, None], heads] = steered[:, heads]

    @functools.cached_property
    def sink_rows(self) -> list[int]:
        """The token rows of this pass that are a sequence's first token (its attention sink: it
        sees no key but its own), which a bank set with ``sink_reads_banks=False`` leaves on the
        stock output (:mod:`hf_memory.steering.sink`); found once per pass, read per layer."""
        if self.decoding:  # a one-token prompt is scheduled as one query
            return [row for row, length in zip(self.rows, self.lengths, strict=True)
                    if length == 1]
        return [self.rows[0]] if self.lengths[0] == len(self.rows) else []

    def history(self, window: int | None, size_normalize: bool):
        """``(blocks [n·B], width, bias)``, on the group's device: the cache blocks holding every
        key some new token sees (the last ``window`` positions with a sliding window, else all),
        row after row; the positions read of each block (``block_size``, or fewer where each row
        reads one block: the tail no row has reached yet is left out); and the mixture's additive
        bias on the ``S = B·width`` positions read
        (:func:`~hf_memory.steering.mixture.history_bias`: −inf past a row's end or outside its
        window). Whole blocks, and widths in steps of :data:`WIDTH_STEP`, keep the products'
        shapes the same over many decoding steps (a product of a new shape costs the CPU's BLAS
        a fresh plan: 3x at 32 requests). Made once per pass, window and normalisation, for every
        steered layer."""
        if (window, size_normalize) not in self._history:
            blocks, visible = self._visible(window)
            width = visible.shape[-1] // blocks.shape[1]
            bias = history_bias(visible, batch=len(blocks), span=visible.shape[-1],
                                kv_heads=self.kv_heads, heads=self.heads,
                                size_normalize=size_normalize, dtype=self.dtype)
            self._history[window, size_normalize] = (blocks.flatten().to(self.device), width,
                                                     bias.to(self.device))
        return self._history[window, size_normalize]

    def _visible(self, window: int | None):
        """The blocks of every row ``[n, B]``, and which of their positions read each query sees
        (``[n, 1, T, B·width]``)."""
        size = self.block_size
        lengths = torch.tensor(self.lengths)
        if self.decoding and window is None:  # each row sees its own keys: its first blocks
            count = (max(self.lengths) - 1) // size + 1
            width = size if count > 1 else _width(max(self.lengths), size)
            seen = torch.arange(count * width) < lengths[:, None]
            return self.table[:, :count], seen[:, None, None]
        queries = 1 if self.decoding else len(self.rows)
        query = lengths[:, None] - queries + torch.arange(queries)  # [n, T] positions
        first = torch.zeros_like(lengths)
        if window is not None:  # the first key the first new token sees
            first = (lengths - queries - window + 1).clamp(min=0)
        start = first // size
        count = int(((lengths - 1) // size - start).max()) + 1
        width = size if count > 1 else _width(int((lengths - start * size).max()), size)
        columns = start[:, None] + torch.arange(count)  # past a row's end: never seen
        positions = (columns[:, :, None] * size + torch.arange(width)).flatten(1)  # [n, S]
        seen = positions[:, None, :] <= query[:, :, None]
        if window is not None:
            seen &= query[:, :, None] - positions[:, None, :] < window
        blocks = self.table.gather(1, columns.clamp(max=self.table.shape[1] - 1))
        return blocks, seen[:, None]


def _width(needed: int, block_size: int) -> int:
    """The positions read of a single block when the furthest row needs ``needed`` of them:
    rounded up to a multiple of :data:`WIDTH_STEP`, at most the whole block."""
    return min(block_size, -(-needed // WIDTH_STEP) * WIDTH_STEP)


@dataclass
class _Step:
    """The forward pass in progress: its steered groups, and per layer the groups steering there
    and the rows/slots whose keys go to the shadow cache."""

    context: Any
    groups: list[_Group]
    slot_mapping: torch.Tensor | None = None  # on the model's device
    layers: dict[int, tuple | None] = dataclasses.field(default_factory=dict)

    def at(self, layer: int):
        """``(groups, rows, slots)`` at ``layer`` (None when no steered request uses it)."""
        if layer not in self.layers:
            groups = [group for group in self.groups if layer in group.sites]
            if groups:
                rows = _index([row for group in groups for row in group.rows],
                              self.slot_mapping.device)
                self.layers[layer] = (groups, rows, self.slot_mapping[rows].long())
            else:
                self.layers[layer] = None
        return self.layers[layer]


ROTARY_CLASSES = {"llama": "llama.modeling_llama.LlamaRotaryEmbedding",
                  "qwen2": "qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
                  "qwen3": "qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
                  "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding",
                  "granite": "granite.modeling_granite.GraniteRotaryEmbedding",
                  "phi3": "phi3.modeling_phi3.Phi3RotaryEmbedding",
                  "mistral": "mistral.modeling_mistral.MistralRotaryEmbedding",
                  "mixtral": "mixtral.modeling_mixtral.MixtralRotaryEmbedding",
                  "gemma2": "gemma2.modeling_gemma2.Gemma2RotaryEmbedding",
                  "gemma3_text": "gemma3.modeling_gemma3.Gemma3RotaryEmbedding"}


def _rotary(hf_config):
    """Layer → the transformers rotary map of the model family at that layer (bank keys are
    prepared with it, exactly as ``steer()`` prepares them; Gemma 3's local and global layers
    have their own)."""
    module, name = ROTARY_CLASSES[hf_config.model_type].rsplit(".", 1)
    rotary = getattr(importlib.import_module(f"transformers.models.{module}"), name)(
        config=hf_config)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and "layer_type" in inspect.signature(rotary.forward).parameters:
        return lambda layer: functools.partial(rotary, layer_type=layer_types[layer])
    return lambda _layer: rotary


class WorkerSteering:
    """Memory-inception steering for one vLLM model instance (see the module docstring).

    Inert (no hooks at all) when ``$HF_MEMORY_VLLM_REGISTRY`` is unset.
    """

    def __init__(self, model: nn.Module, vllm_config) -> None:
        self.registry = Registry.from_env()
        self.model = model
        self.block_size = self.head_dim = 0
        self.hf_config = vllm_config.model_config.hf_config
        self.bank_sets: dict[str, BankSet] = {}
        self.selectors: dict[str, Selector] = {}
        self._plans: dict[tuple, dict[int, _Site]] = {}
        self.layers: list[int] = []
        self._shadow: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._queries: dict[int, torch.Tensor] = {}
        self._step: _Step | None = None
        if self.registry is None:
            return
        model_type = self.hf_config.model_type
        if model_type not in QUERY_SOURCES:
            raise UnsupportedModelError(
                f"hf-memory steering is configured but model_type {model_type!r} has no adapter; "
                f"supported: {', '.join(QUERY_SOURCES)}")
        if vllm_config.speculative_config is not None:
            raise ValueError("hf-memory steering does not run with speculative decoding (vLLM "
                             "loads no custom logits processors there)")
        from vllm.config import CompilationMode

        if vllm_config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError("hf-memory steering runs eagerly (its attention hooks branch per "
                             "request): start vLLM with --enforce-eager")
        if getattr(vllm_config, "use_v2_model_runner", False):
            raise ValueError("hf-memory steering needs vLLM's V1 model runner: set "
                             "VLLM_USE_V2_MODEL_RUNNER=0")
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        config = self.hf_config
        if config.num_key_value_heads % self.tp_size:
            raise ValueError(f"hf-memory steering shards banks by KV head: "
                             f"{config.num_key_value_heads} KV heads over {self.tp_size} ranks")
        self.heads = config.num_attention_heads // self.tp_size
        self.kv_heads = config.num_key_value_heads // self.tp_size
        self.block_size = vllm_config.cache_config.block_size
        self.model_type = model_type

    # -- loading -------------------------------------------------------------------------------

    def served_fingerprint(self) -> dict[str, Any]:
        """The served model's fingerprint, from vLLM's fused weights (key rows of qkv_proj)."""
        layers = self.model.model.layers
        first, last = layers[0].self_attn, layers[len(layers) - 1].self_attn
        digests = []
        for attention in (first, last):
            weight = attention.qkv_proj.weight
            digests.append(weight[attention.q_size:attention.q_size + attention.kv_size])
        dtype = str(first.qkv_proj.weight.dtype)
        digest = weights_digest(digests if first is not last else digests[:1])
        return fingerprint_of(self.hf_config, dtype=dtype, digest=digest)

    def bind(self) -> None:
        """After the weights are loaded: check them against the registry, load the bank sets."""
        if self.registry is None:
            return
        served = self.served_fingerprint()
        ignore = FINGERPRINT_IGNORES + (("weights_digest",) if self.tp_size > 1 else ())
        try:
            compare_fingerprints(self.registry.model, served, f"the registry {self.registry.path}",
                                 ignore=ignore)
        except FingerprintMismatchError as error:
            raise FingerprintMismatchError(f"{error}: point ${'HF_MEMORY_VLLM_REGISTRY'} at a "
                                           "registry written for the served model") from None
        for name, entry in self.registry.bank_sets.items():
            try:
                bank_set = BankSet.from_pretrained(entry["banks"])
                bank_set.check_fingerprint(served, ignore=ignore)
                self.registry.check_size(name, bank_set)
            except (FingerprintMismatchError, ValueError) as error:
                logger.warning("hf-memory: bank set %r cannot steer this model and will be "
                               "refused: %s", name, error)
                continue
            slot_layers, nbytes = bank_set_size(bank_set)
            logger.info("hf-memory: bank set %r: %d slot-layers, %.2f MiB", name, slot_layers,
                        nbytes / 2**20)
            self.bank_sets[name] = bank_set
        # bank keys prepared at start, not at a request; only the layers some servable steering
        # steers are hooked (a selector usually picks a few of the layers its banks cover)
        steered: set[int] = set()
        for name in self.bank_sets:
            for selector in (None, *self.registry.selectors):
                try:
                    steered.update(self.plan(SteeringRequest(name, selector)))
                except (KeyError, ValueError) as error:
                    logger.warning("hf-memory: bank set %r with selector %r cannot be planned "
                                   "and will fail: %s", name, selector, error)
        self.layers = sorted(steered)
        self._install(self.model_type)
        logger.info("hf-memory steering: %d bank sets at layers %s", len(self.bank_sets),
                    self.layers)

    def _selector(self, request: SteeringRequest) -> Selector | None:
        directory = self.registry.selector_dir(request)
        if directory is None:
            return None
        if directory not in self.selectors:
            self.selectors[directory] = Selector.from_pretrained(directory)
        return self.selectors[directory]

    def plan(self, request: SteeringRequest) -> dict[int, _Site]:
        """The sites of one steering request on this worker's shard (cached)."""
        if request.key in self._plans:
            return self._plans[request.key]
        if request.bank_set not in self.bank_sets:
            raise KeyError(f"bank set {request.bank_set!r} is not loaded in this worker")
        selector = self._selector(request)
        site_args: dict[str, Any] = {}
        if selector is not None:
            site_args = {"layers": selector.layers, "units": selector.units,
                         "unit_type": selector.unit_type, "layer_gains": selector.layer_gains}
        bank_set = self.bank_sets[request.bank_set]
        if request.scale != 1.0:
            base = site_args.get("layer_gains") or {}
            layers = site_args.get("layers") or sorted(
                {i for bank in bank_set.banks for i in bank.layers})
            site_args["layer_gains"] = {layer: request.scale * float(base.get(layer, 1.0))
                                        for layer in layers}
        parameter = next(self.model.parameters())
        plans = plan_sites(bank_set, config=self.hf_config, rotary=_rotary(self.hf_config),
                           device=parameter.device,
                           dtype=torch.promote_types(parameter.dtype, torch.float32),
                           **site_args)
        strength = 1.0 if selector is None else selector.strength  # the selector's dial
        sites = {layer: self._shard(plan, strength, bank_set.sink_reads_banks)
                 for layer, plan in plans.items() if plan.stack is not None and strength > 0}
        sites = {layer: site for layer, site in sites.items()  # no head of it on this rank
                 if isinstance(site.heads, slice) or len(site.heads)}
        self._plans[request.key] = sites
        return sites

    def _shard(self, plan: SitePlan, strength: float, sink_reads_banks: bool) -> _Site:
        """This rank's KV heads of the banks and its query heads, renumbered locally."""
        first_head = self.tp_rank * self.heads
        heads = [h - first_head for h in plan.heads if first_head <= h < first_head + self.heads]
        kv = slice(self.tp_rank * self.kv_heads, (self.tp_rank + 1) * self.kv_heads)
        stack = dataclasses.replace(plan.stack, keys=plan.stack.keys[kv],
                                    values=plan.stack.values[kv])
        index = (slice(None) if heads == list(range(self.heads)) else
                 torch.tensor(heads, dtype=torch.long, device=stack.keys.device))
        return _Site(heads=index, stack=stack, gamma=plan.gamma,
                     size_normalize=plan.size_normalize, strength=strength,
                     sink_reads_banks=sink_reads_banks)

    # -- hooks ---------------------------------------------------------------------------------

    def _install(self, model_type: str) -> None:
        from vllm import forward_context

        self._forward_context = forward_context  # read at every hooked layer: imported once
        layers = self.model.model.layers
        source = QUERY_SOURCES[model_type]
        if self.layers:
            self.head_dim = layers[self.layers[0]].self_attn.head_dim
        for index in self.layers:
            attention = layers[index].self_attn
            getattr(attention, source).register_forward_hook(
                lambda _m, _a, out, i=index, a=attention: self._capture_query(i, a, out))
            attention.attn.register_forward_hook(
                lambda _m, args, out, i=index, a=attention: self._steer(i, a, args, out))

    def _current_step(self, layer_name: str) -> _Step | None:
        if not self._forward_context.is_forward_context_available():
            return None
        context = self._forward_context.get_forward_context()
        if self._step is not None and self._step.context is context:
            return self._step
        metadata = context.attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0]
        metadata = metadata.get(layer_name) if metadata else None
        groups = self._groups(metadata) if metadata is not None and BATCH else []
        self._step = _Step(context, groups, metadata.slot_mapping if groups else None)
        self._queries.clear()
        return self._step

    def _groups(self, metadata) -> list[_Group]:
        """The steered requests of this pass, grouped (decoding: by steering; prefill: alone),
        with their rows of vLLM's block table."""
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()
        decoding: dict[tuple, list[int]] = {}
        prefill: list[int] = []
        requests: dict[tuple, SteeringRequest] = {}
        for index, request in BATCH.items():
            if index >= len(lengths):
                continue
            if request.bank_set not in self.bank_sets:
                raise RuntimeError(f"hf-memory: bank set {request.bank_set!r} was refused by "
                                   "this worker (see its log) but accepted by the API")
            if starts[index + 1] - starts[index] == 1:
                decoding.setdefault(request.key, []).append(index)
                requests[request.key] = request
            else:
                prefill.append(index)
        groups, device = [], metadata.slot_mapping.device

        def group_of(sites, rows, lengths, table, decoding: bool) -> _Group:
            dtype = next(iter(sites.values())).stack.keys.dtype
            return _Group(sites, rows, lengths, table.cpu().long(), self.block_size,
                          decoding=decoding, device=device, heads=self.heads,
                          kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=dtype)

        for key, indices in decoding.items():
            sites = self.plan(requests[key])
            if sites:
                groups.append(group_of(sites, [starts[i] for i in indices],
                                       [lengths[i] for i in indices],
                                       metadata.block_table[indices], decoding=True))
        for index in prefill:
            sites = self.plan(BATCH[index])
            if sites:
                group = group_of(sites, list(range(starts[index], starts[index + 1])),
                                 [lengths[index]], metadata.block_table[index:index + 1],
                                 decoding=False)
                self._check_layout(group, metadata.slot_mapping[group.index].cpu().long())
                groups.append(group)
        return groups

    def _check_layout(self, group: _Group, mapping: torch.Tensor) -> None:
        """The slots vLLM writes a prefill's tokens to must be where its block table says (the
        history is read back by block)."""
        positions = torch.arange(group.lengths[0] - len(group.rows), group.lengths[0])
        slots = (group.table[0, positions // self.block_size] * self.block_size
                 + positions % self.block_size)
        if not torch.equal(slots, mapping):
            raise RuntimeError("hf-memory: the block table and slot mapping disagree at block "
                               f"size {self.block_size}; this vLLM backend lays out its cache "
                               "in a way the plugin does not know")

    def _capture_query(self, layer: int, attention: nn.Module, output) -> None:
        step = self._current_step(attention.attn.layer_name)
        if step is None or step.at(layer) is None:
            return
        query = output[0] if isinstance(output, tuple) else output
        if query.dim() == 3:  # q_norm: [T, H, D]
            query = query.reshape(query.shape[0], -1)
        self._queries[layer] = query[:, :attention.q_size].clone()

    def _steer(self, layer: int, attention: nn.Module, args, output: torch.Tensor) -> None:
        step = self._current_step(attention.attn.layer_name)
        if step is None or step.at(layer) is None:
            return
        groups, rows, slots = step.at(layer)
        query, key = args[:2]
        head_dim = attention.head_dim
        # only steered requests read the shadow cache, and their prefix-cache blocks are salted
        # per steering, so only their tokens are written (plain batches pay nothing here)
        by_slot, by_block = self._shadow_cache(layer, attention)
        keys = _rows_view(key, rows, self.kv_heads, head_dim)
        if keys is None:
            keys = key[rows].view(-1, self.kv_heads, 1, head_dim).transpose(0, 1)
        by_slot.index_copy_(1, slots, keys.squeeze(2))
        q_pre = self._queries.pop(layer)
        # the scores as vLLM's own attention layer makes them: scale, soft-cap (0: none), window
        scaling, softcap = attention.scaling, attention.attn.impl.logits_soft_cap or None
        window = attention.attn.sliding_window
        for group in groups:
            site = group.sites[layer]
            blocks, width, bias = group.history(window, site.size_normalize)
            # [KVH, n, S, D]: whole blocks gathered KV-head major, row after row (a copy of
            # whole blocks is 25x faster than one of their first positions), then the first
            # ``width`` positions of each read (a view: a row's one block when width < block)
            history = by_block.index_select(1, blocks)[:, :, :width].reshape(
                self.kv_heads, len(group.lengths), -1, head_dim)
            mixed = MIXTURE(group.queries(output), group.queries(q_pre),
                            group.queries(query), history, bias, site.stack,
                            scaling=scaling, gamma=site.gamma, softcap=softcap,
                            strength=site.strength)
            sinks = [] if site.sink_reads_banks else group.sink_rows
            kept = output[sinks].clone() if sinks else None  # vLLM's own output for them
            group.put(output, site.heads, mixed)
            if kept is not None:
                output[sinks] = kept

    def _shadow_cache(self, layer: int, attention: nn.Module):
        """Keys of every cache slot at ``layer``, KV-head major: ``[KVH, slots, D]`` and the same
        tensor by block ``[KVH, blocks, block_size, D]`` (values are never read back: vLLM's own
        output stands for them)."""
        if layer not in self._shadow:
            cache = attention.attn.kv_cache
            if isinstance(cache, list | tuple):
                cache = cache[0]
            slots = cache.numel() // (2 * self.kv_heads * attention.head_dim)
            by_slot = cache.new_zeros(self.kv_heads, slots, attention.head_dim)
            self._shadow[layer] = by_slot, by_slot.view(self.kv_heads, -1, self.block_size,
                                                        attention.head_dim)
        return self._shadow[layer]
