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
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from hf_memory.models.adapters import UnsupportedModelError

from .registry import REGISTRY_ENV, Registry, RegistryError, parse_request
from .worker import BATCH, QUERY_SOURCES

__all__ = ["MemorySteeringRequests"]


class MemorySteeringRequests(LogitsProcessor):
    """Tracks which requests of the batch steer with which bank set (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """In the API process: a bad steering request is refused alone (HTTP 400 when served)."""
        try:
            request = parse_request(sampling_params.extra_args)
            if request is None:
                return
            registry = Registry.from_env()
            if registry is None:
                raise RegistryError(f"this server has no memory banks: start it with "
                                    f"{REGISTRY_ENV}=<registry.json>")
            registry.validate(request)
        except RegistryError as error:
            raise VLLMValidationError(str(error), parameter="extra_args") from None

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        model_type = vllm_config.model_config.hf_config.model_type
        if Registry.from_env() is not None and model_type not in QUERY_SOURCES:
            raise UnsupportedModelError(
                f"hf-memory steering is configured (${REGISTRY_ENV}) but the served model_type "
                f"{model_type!r} has no adapter; supported: {', '.join(QUERY_SOURCES)}")
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
