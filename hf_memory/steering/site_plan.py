"""What each steered layer computes with: its query heads and its banks, ready to score.

One planner serves every runtime: ``steer()`` on a transformers model and the vLLM plugin both
turn a bank set and a site choice (a selector's layers, units and layer gains, or explicit ones)
into :class:`SitePlan` objects, so the two compute the same mixture from the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from hf_memory.banks.bank import MemoryBank
from hf_memory.banks.bank_set import BankSet
from hf_memory.steering.mixture import BankStack, PreparedBank
from hf_memory.steering.rotary import rotate

__all__ = ["SitePlan", "expand_units", "plan_sites", "prepare_bank"]


@dataclass(frozen=True)
class SitePlan:
    """One steered layer: the query heads it steers and its banks (None: no bank covers it);
    for a contrast bank set (:attr:`BankSet.contrast`) ``stack`` holds the target bank and
    ``minus`` the reference bank, each scored as a bank alone (gain ρλ, no gate)."""

    heads: list[int]
    stack: BankStack | None
    gamma: float
    size_normalize: bool
    minus: BankStack | None = None


def prepare_bank(bank: MemoryBank, row: int, rotary: Callable, device, dtype) -> PreparedBank:
    """Scoring keys for one bank at one layer: canonical, or rotated by phase / position.

    The rotary map of the model multiplies queries and keys by its ``attention_scaling`` a, so
    prompt scores carry a²; bank scores are given the same factor: slots placed at absolute
    positions meet the post-RoPE query (a) with rotated keys (a); canonical and phase-rotated
    slots meet the pre-RoPE query, so their keys carry a² themselves.

    ``rotary`` is the transformers rotary embedding of the model family (``rotary(x, ids)`` →
    ``(cos, sin)``).
    """
    keys = bank.keys[row].to(device=device, dtype=dtype)
    values = bank.values[row].to(device=device, dtype=dtype)
    zero = torch.zeros(1, 1, dtype=torch.long, device=device)
    scale = rotary(keys, zero)[0][0, 0, 0]  # a, rounded exactly as the model's rotary rounds it
    offsets = bank.positions if bank.positions is not None else bank.phases
    if offsets is None:
        keys = keys * scale**2
    else:
        cos, sin = rotary(keys, offsets.to(device=device)[None])
        keys = rotate(keys, cos[0], sin[0])
        if bank.positions is None:
            keys = keys * scale
    return PreparedBank(bank.role, keys, values, bank.gain,
                        post_rope_query=bank.positions is not None)


def expand_units(units: Iterable[int], unit_type: str, heads: int, kv_heads: int) -> list[int]:
    """Query heads of ``units`` (query heads, or KV groups expanded to their query heads)."""
    units = sorted({int(u) for u in units})
    limit = heads if unit_type == "head" else kv_heads
    bad = [u for u in units if not 0 <= u < limit]
    if bad or not units:
        raise ValueError(f"{unit_type} units must be indices in [0, {limit}), got {units}")
    if unit_type == "head":
        return units
    group = heads // kv_heads
    return [g * group + i for g in units for i in range(group)]


def _site_heads(bank_set: BankSet, config, layers, units, unit_type) -> dict[int, list[int]]:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    num_layers = config.num_hidden_layers
    covered = sorted({i for bank in bank_set.banks for i in bank.layers})
    if layers is None and isinstance(units, Mapping):
        layers = units.keys()
    chosen = covered if layers is None else sorted({int(i) for i in layers})
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers must be indices in [0, {num_layers}), got {bad}")
    all_units = range(heads if unit_type == "head" else kv_heads)
    sites = {}
    for layer in chosen:
        if isinstance(units, Mapping):
            layer_units = units.get(layer, units.get(str(layer)))
            if layer_units is None:
                raise ValueError(f"units give no entry for steered layer {layer}")
        else:
            layer_units = all_units if units is None else units
        sites[layer] = expand_units(layer_units, unit_type, heads, kv_heads)
    return sites


def plan_sites(
    bank_set: BankSet,
    *,
    config,
    rotary: Callable[[int], Callable],
    device: torch.device | str,
    dtype: torch.dtype,
    layers: Sequence[int] | None = None,
    units: Sequence[int] | Mapping[int, Sequence[int]] | None = None,
    unit_type: str = "head",
    layer_gains: Mapping[int, float] | None = None,
    gamma: float | None = None,
    size_normalize: bool | None = None,
) -> dict[int, SitePlan]:
    """Plan every steered layer of a model with ``config`` (see :class:`SteeringHandle` for the
    meaning and defaults of the site arguments); banks are prepared in ``dtype`` on ``device``,
    with ``rotary(layer)``, the layer's rotary map.
    """
    if unit_type not in ("head", "kv_group"):
        raise ValueError(f"unit_type must be 'head' or 'kv_group', got {unit_type!r}")
    gains = dict(layer_gains or {})
    normalize = bank_set.size_normalize if size_normalize is None else bool(size_normalize)
    plans = {}
    for layer, heads in _site_heads(bank_set, config, layers, units, unit_type).items():
        prepared = [prepare_bank(bank, bank.layer_index(layer), rotary(layer), device, dtype)
                    for bank in bank_set.banks if bank.layer_index(layer) is not None]
        rho = float(gains.get(layer, gains.get(str(layer), 1.0)))
        minus = None
        if bank_set.contrast and prepared:
            minus = BankStack.of([replace(bank, role="target") for bank in prepared
                                  if bank.role == "reference"], rho=rho, size_normalize=normalize)
            prepared = [bank for bank in prepared if bank.role == "target"]
        plans[layer] = SitePlan(
            heads=heads,
            stack=BankStack.of(prepared, rho=rho, size_normalize=normalize) if prepared else None,
            gamma=bank_set.gamma if gamma is None else float(gamma),
            size_normalize=normalize, minus=minus)
    return plans
