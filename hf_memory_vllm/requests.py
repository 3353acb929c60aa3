"""Per-request steering in vLLM: a logits processor that reads ``extra_args`` and changes no logit.

vLLM's V1 engine validates every request's sampling parameters with each installed logits
processor in the API process (a ``ValueError`` there is an HTTP 400 for that request alone) and
tells each worker's processors which request sits at which batch index before every forward
pass. This processor uses both: it rejects bad steering arguments up front, and it keeps
:data:`hf_memory_vllm.worker.BATCH` (batch index → steering) for the worker's attention hooks.
``apply`` returns the logits unchanged.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .registry import Registry, RegistryError, parse_request
from .worker import BATCH

__all__ = ["MemorySteeringRequests"]


class MemorySteeringRequests(LogitsProcessor):
    """Tracks which requests of the batch steer with which bank set (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        request = parse_request(sampling_params.extra_args)
        if request is None:
            return
        registry = Registry.from_env()
        if registry is None:
            raise RegistryError("this server has no memory banks: start it with "
                                "HF_MEMORY_VLLM_REGISTRY=<registry.json>")
        registry.validate(request)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        BATCH.clear()

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            BATCH.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            request = parse_request(params.extra_args) if params is not None else None
            if request is None:
                BATCH.pop(index, None)
            else:
                BATCH[index] = request
        for source, target, direction in batch_update.moved:
            moving = BATCH.pop(source, None)
            if direction == MoveDirectionality.SWAP:
                swapped = BATCH.pop(target, None)
                if swapped is not None:
                    BATCH[source] = swapped
            else:
                BATCH.pop(target, None)
            if moving is not None:
                BATCH[target] = moving
