"""The steered attention inside a vLLM worker: memory banks added to stock attention layers.

Each worker holds one :class:`WorkerSteering` for its model. At the attention layers some
registered bank set covers it hooks three places of vLLM's own modules (their code unchanged):

- the query projection (``qkv_proj`` for Llama/Qwen2, ``q_norm`` for Qwen3): a copy of the
  pre-RoPE query of the steered tokens (vLLM's rotary embedding rotates in place);
- the attention layer's output: the steered requests' keys and values are also written to a
  *shadow cache* indexed by vLLM's own slot mapping (so their history can be read back whatever
  the attention backend's cache layout), and for every steered request the rows of its
  tokens at its steered heads are replaced by :func:`hf_memory.mixture.bank_mixture` over the
  request's full history and its banks: the same function, on the same bank tensors
  (:func:`hf_memory.site_plan.plan_sites`), that ``steer()`` computes in transformers.

Which request steers with what comes from :mod:`hf_memory_vllm.requests`, the logits processor
that sees every request's ``extra_args`` as it joins the batch. Requests without steering, and
layers no steered request uses, run vLLM's attention untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_memory import BankSet, Selector
from hf_memory.adapters import SUPPORTED_MODEL_TYPES, UnsupportedModelError
from hf_memory.fingerprint import (
    FingerprintMismatchError,
    compare_fingerprints,
    fingerprint_of,
    weights_digest,
)
from hf_memory.mixture import BankStack, bank_mixture, toward, visible_keys
from hf_memory.site_plan import SitePlan, plan_sites

from .registry import FINGERPRINT_IGNORES, Registry, SteeringRequest, bank_set_size

__all__ = ["BATCH", "WorkerSteering"]

logger = logging.getLogger(__name__)

# model_type → the module whose output is the pre-RoPE query ("qkv_proj": its query columns);
# the architectures served steered by vLLM, a subset of those steer() supports
QUERY_SOURCES = {"llama": "qkv_proj", "qwen2": "qkv_proj", "qwen3": "q_norm",
                 "qwen3_moe": "q_norm", "granite": "qkv_proj", "phi3": "qkv_proj",
                 "mistral": "qkv_proj", "mixtral": "qkv_proj", "gemma2": "qkv_proj",
                 "gemma3_text": "q_norm"}
assert set(QUERY_SOURCES) <= set(SUPPORTED_MODEL_TYPES)

# persistent-batch index → steering, kept by the logits processor of this worker
BATCH: dict[int, SteeringRequest] = {}


@dataclass
class _Site:
    """A plan at one layer, on this worker's shard of heads."""

    heads: torch.Tensor
    stack: BankStack
    gamma: float
    size_normalize: bool
    strength: float = 1.0


@dataclass
class _Step:
    """The forward pass in progress: per layer, its steered requests' (site, first row, end row,
    cache slots of the whole history)."""

    context: Any
    work: dict[int, list[tuple[_Site, int, int, torch.Tensor]]]


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


def _windowed(q_len: int, kv_len: int, window: int | None, device) -> torch.Tensor:
    """Causal visibility ``[1, 1, T, S]`` of ``q_len`` new tokens over ``kv_len`` keys ending
    with them; with a sliding ``window``, key j is seen from position p only if p − j < window
    (transformers' and vLLM's sliding attention). Bank slots have no position: they stay
    visible to every query (the mixture adds them)."""
    visible = visible_keys(None, q_len, kv_len, device)
    if window is None:
        return visible
    query = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return visible & (query - torch.arange(kv_len, device=device)[None, :] < window)


class WorkerSteering:
    """Memory-inception steering for one vLLM model instance (see the module docstring).

    Inert (no hooks at all) when ``$HF_MEMORY_VLLM_REGISTRY`` is unset.
    """

    def __init__(self, model: nn.Module, vllm_config) -> None:
        self.registry = Registry.from_env()
        self.model = model
        self.block_size = 0
        self.hf_config = vllm_config.model_config.hf_config
        self.bank_sets: dict[str, BankSet] = {}
        self.selectors: dict[str, Selector] = {}
        self._plans: dict[tuple, dict[int, _Site]] = {}
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
        self.layers = self._covered_layers()
        self._install(model_type)

    # -- loading -------------------------------------------------------------------------------

    def _covered_layers(self) -> list[int]:
        """Every layer some registered bank covers (read from the bank sets' configs)."""
        covered: set[int] = set()
        for entry in self.registry.bank_sets.values():
            config = json.loads((Path(entry["banks"]) / "config.json").read_text())
            covered.update(i for bank in config["banks"] for i in bank["layers"])
        return sorted(covered)

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
            self.plan(SteeringRequest(name))  # bank keys prepared at start, not at a request
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
        sites = {layer: self._shard(plan, strength) for layer, plan in plans.items()
                 if plan.stack is not None and strength > 0}
        self._plans[request.key] = sites
        return sites

    def _shard(self, plan: SitePlan, strength: float) -> _Site:
        """This rank's KV heads of the banks and its query heads, renumbered locally."""
        first_head = self.tp_rank * self.heads
        heads = [h - first_head for h in plan.heads if first_head <= h < first_head + self.heads]
        kv = slice(self.tp_rank * self.kv_heads, (self.tp_rank + 1) * self.kv_heads)
        stack = dataclasses.replace(plan.stack, keys=plan.stack.keys[kv],
                                    values=plan.stack.values[kv])
        return _Site(heads=torch.tensor(heads, dtype=torch.long, device=stack.keys.device),
                     stack=stack, gamma=plan.gamma, size_normalize=plan.size_normalize,
                     strength=strength)

    # -- hooks ---------------------------------------------------------------------------------

    def _install(self, model_type: str) -> None:
        layers = self.model.model.layers
        source = QUERY_SOURCES[model_type]
        for index in self.layers:
            attention = layers[index].self_attn
            getattr(attention, source).register_forward_hook(
                lambda _m, _a, out, i=index: self._capture_query(i, out))
            attention.attn.register_forward_hook(
                lambda _m, args, out, i=index, a=attention: self._steer(i, a, args, out))

    def _current_step(self, layer_name: str) -> _Step | None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        context = get_forward_context()
        if self._step is not None and self._step.context is context:
            return self._step
        metadata = context.attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0]
        metadata = metadata.get(layer_name) if metadata else None
        rows = []
        if metadata is not None and BATCH:
            starts = metadata.query_start_loc.tolist()
            lengths = metadata.seq_lens.tolist()
            mapping = metadata.slot_mapping
            for index, request in BATCH.items():
                if index >= len(lengths):
                    continue
                if request.bank_set not in self.bank_sets:
                    raise RuntimeError(f"hf-memory: bank set {request.bank_set!r} was refused "
                                       "by this worker (see its log) but accepted by the API")
                positions = torch.arange(lengths[index])
                blocks = metadata.block_table[index][positions // self.block_size].cpu().long()
                slots = blocks * self.block_size + positions % self.block_size
                row0, row1 = starts[index], starts[index + 1]
                if not torch.equal(slots[len(slots) - (row1 - row0):],
                                   mapping[row0:row1].cpu().long()):
                    raise RuntimeError("hf-memory: the block table and slot mapping disagree "
                                       f"at block size {self.block_size}; this vLLM backend "
                                       "lays out its cache in a way the plugin does not know")
                rows.append((request, row0, row1, slots))
        work: dict[int, list[tuple[_Site, int, int, torch.Tensor]]] = {}
        for request, row0, row1, slots in rows:
            for layer, site in self.plan(request).items():
                if len(site.heads):
                    work.setdefault(layer, []).append((site, row0, row1, slots))
        self._step = _Step(context, work)
        self._queries.clear()
        return self._step

    def _capture_query(self, layer: int, output) -> None:
        attention = self.model.model.layers[layer].self_attn
        step = self._current_step(attention.attn.layer_name)
        if step is None or not step.work.get(layer):
            return
        query = output[0] if isinstance(output, tuple) else output
        if query.dim() == 3:  # q_norm: [T, H, D]
            query = query.reshape(query.shape[0], -1)
        self._queries[layer] = query[:, :attention.q_size].clone()

    def _steer(self, layer: int, attention: nn.Module, args, output: torch.Tensor) -> None:
        step = self._current_step(attention.attn.layer_name)
        if step is None:
            return
        work = step.work.get(layer)
        if not work:
            return
        query, key, value = args[:3]
        head_dim = attention.head_dim
        # only steered requests read the shadow cache, and their prefix-cache blocks are salted
        # per steering, so only their tokens are written (plain batches pay nothing here)
        rows = torch.cat([torch.arange(row0, row1) for _, row0, row1, _ in work])
        slots = torch.cat([slots[len(slots) - (row1 - row0):] for _, row0, row1, slots in work])
        shadow_k, shadow_v = self._shadow_cache(layer, attention)
        shadow_k[slots] = key[rows].reshape(len(rows), self.kv_heads, head_dim)
        shadow_v[slots] = value[rows].reshape(len(rows), self.kv_heads, head_dim)
        q_pre = self._queries.pop(layer)
        out = output.view(output.shape[0], self.heads, head_dim)
        post = query.reshape(query.shape[0], self.heads, head_dim)
        pre = q_pre.view(q_pre.shape[0], self.heads, head_dim)
        # the scores as vLLM's own attention layer makes them: scale, soft-cap (0: none), window
        score = (attention.scaling, attention.attn.impl.logits_soft_cap or None)
        window = attention.attn.sliding_window
        decoding: dict[int, list[tuple[_Site, int, int, torch.Tensor]]] = {}
        for item in work:
            site, row0, row1, slots = item
            if window is not None:  # the keys some new token still sees
                slots = slots[max(0, len(slots) - (row1 - row0) - window + 1):]
            if row1 - row0 == 1:  # one new token: batched below with the same site's others
                decoding.setdefault(id(site), []).append((site, row0, row1, slots))
                continue
            mixed = self._mixture(site, pre[row0:row1].transpose(0, 1)[None],
                                  post[row0:row1].transpose(0, 1)[None], shadow_k[slots][None],
                                  shadow_v[slots][None],
                                  _windowed(row1 - row0, len(slots), window, out.device),
                                  score)
            steered = toward(out[row0:row1, site.heads],
                             mixed[0, site.heads].transpose(0, 1), site.strength)
            out[row0:row1, site.heads] = steered.to(out.dtype)
        for items in decoding.values():
            self._decode(items, pre, post, out, shadow_k, shadow_v, score)

    def _decode(self, items, pre, post, out, shadow_k, shadow_v, score: tuple) -> None:
        """One mixture for the single-token rows of requests at the same site: histories are
        padded to the longest and the padding masked (``visible``), which the mixture's
        size normalisation counts out."""
        site = items[0][0]
        rows = torch.tensor([row0 for _, row0, _, _ in items], device=out.device)
        lengths = torch.tensor([len(slots) for *_, slots in items])
        padded = torch.zeros(len(items), int(lengths.max()), dtype=torch.long)
        for i, (*_, slots) in enumerate(items):
            padded[i, :len(slots)] = slots
        visible = (torch.arange(padded.shape[1]) < lengths[:, None])[:, None, None]
        mixed = self._mixture(site, pre[rows][:, :, None], post[rows][:, :, None],
                              shadow_k[padded], shadow_v[padded], visible.to(out.device),
                              score)
        steered = toward(out[rows[:, None], site.heads], mixed[:, site.heads, 0],
                         site.strength)
        out[rows[:, None], site.heads] = steered.to(out.dtype)

    @staticmethod
    def _mixture(site: _Site, q_pre, q_post, keys, values, visible, score: tuple):
        """:func:`bank_mixture` on queries ``[B, H, T, D]`` and cached ``[B, S, KVH, D]``;
        ``score``: the layer's ``(scale, soft-cap or None)``."""
        scaling, softcap = score
        mixed, _ = bank_mixture(q_pre, q_post, keys.permute(0, 2, 1, 3),
                                values.permute(0, 2, 1, 3), visible, site.stack,
                                scaling=scaling, gamma=site.gamma,
                                size_normalize=site.size_normalize, softcap=softcap)
        return mixed

    def _shadow_cache(self, layer: int, attention: nn.Module):
        """Keys and values of every cache slot at ``layer`` in the standard layout."""
        if layer not in self._shadow:
            cache = attention.attn.kv_cache
            if isinstance(cache, list | tuple):
                cache = cache[0]
            slots = cache.numel() // (2 * self.kv_heads * attention.head_dim)
            shape = (slots, self.kv_heads, attention.head_dim)
            self._shadow[layer] = (cache.new_zeros(shape), cache.new_zeros(shape))
        return self._shadow[layer]
