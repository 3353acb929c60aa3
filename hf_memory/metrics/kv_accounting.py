"""KV-cache accounting (paper eq. 10): memory banks vs the same guidance as a visible prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from hf_memory.banks.bank_set import BankSet
from hf_memory.models.transformers_compat import output_cache

__all__ = ["KVFootprint", "kv_footprint", "prompt_kv_bytes"]


@dataclass(frozen=True)
class KVFootprint:
    """Idealised and actual KV cost of guidance as banks vs as visible prompt tokens."""

    num_layers: int
    prompt_tokens: int
    controlled_layers: int
    bank_slots: int
    idealised_ratio: float
    prompt_kv_bytes: int
    bank_bytes: int
    actual_ratio: float

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def prompt_kv_bytes(model: nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes of the KV cache the model actually builds for ``input_ids`` ``[1, T]``."""
    device = next(model.parameters()).device
    cache = output_cache(model(input_ids=input_ids.to(device), use_cache=True))
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            total += tensor.numel() * tensor.element_size()
    return total


def kv_footprint(
    model: nn.Module,
    bank_set: BankSet,
    prompt_ids: torch.Tensor,
    layers: Sequence[int] | None = None,
) -> KVFootprint:
    """Compare ``bank_set`` at ``layers`` (default: all it covers) with ``prompt_ids`` visible.

    Idealised ratio = L·T_prompt / (L_ctrl·S_bank), S_bank = slots over all banks; actual ratio =
    bytes of the prompt's KV cache / bytes of the bank tensors at the controlled layers (banks
    are counted in the dtype they are stored in).
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [1, T] with T > 0, got {tuple(prompt_ids.shape)}")
    if not len(bank_set):
        raise ValueError("the bank set is empty")
    covered = sorted({i for bank in bank_set for i in bank.layers})
    controlled = covered if layers is None else sorted(set(layers) & set(covered))
    if not controlled:
        raise ValueError(f"none of layers {list(layers or [])} is covered by the banks")
    num_layers = model.config.num_hidden_layers
    slots = sum(bank.num_slots for bank in bank_set)
    tokens = prompt_ids.shape[1]
    prompt_bytes = prompt_kv_bytes(model, prompt_ids)
    bank_bytes = sum(bank.nbytes(controlled) for bank in bank_set)
    return KVFootprint(
        num_layers=num_layers, prompt_tokens=tokens, controlled_layers=len(controlled),
        bank_slots=slots, idealised_ratio=num_layers * tokens / (len(controlled) * slots),
        prompt_kv_bytes=prompt_bytes, bank_bytes=bank_bytes,
        actual_ratio=prompt_bytes / bank_bytes)
