"""The paper's diagnostic site selection (section 3.1, eq. 3, 11–12, algorithm 1, appendix C).

Calibration runs prompts through the *unsteered* model while every candidate site traces what it
would route (``steer(..., trace_only=True)``), and records per query head:

- the alignment margin a = max_j q̄·k⁺_j/√d − max_j q̄·k⁻_j/√d (eq. 3), pre-RoPE query q̄;
- the routing mass π of the target bank m⁺, the reference bank m⁻ and the prompt m^x.

Means over every non-padding calibration position give the unit score
U = ā + ξ·m̄⁺ − χ·m̄^x (eq. 11). Units are query heads, or KV groups (the mean over a group's
heads, expanded back to its heads at steering time). The top-k units of each layer are kept, the
layer score aggregates them (sum or mean, eq. 12), the top-m layers are kept, and layer gains ρ_ℓ
are assigned. The result freezes into a :class:`~hf_memory.selection.selector.Selector`:
``steer(model, banks, selector=selector)`` applies it with no further search.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_memory.banks.bank_set import BankSet
from hf_memory.banks.capture import capture_outputs
from hf_memory.chat.generation import chat_messages
from hf_memory.models.adapters import get_adapter
from hf_memory.models.fingerprint import model_fingerprint
from hf_memory.selection.search_types import (
    AttentionConfig,
    SelectionResult,
    config_from,
    keyword_defaults,
)
from hf_memory.steering.handle import steer

__all__ = ["DIAGNOSTICS", "alignment_margin", "calibrate_by_attention", "select_sites",
           "unit_scores"]

DIAGNOSTICS = ("alignment", "target_mass", "reference_mass", "prompt_mass", "score")


def alignment_margin(
    queries: torch.Tensor, target_keys: torch.Tensor, reference_keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """Eq. 3 per query: ``max_j q·k⁺_j·scale − max_j q·k⁻_j·scale``.

    Args:
        queries: pre-RoPE queries ``[..., H, T, D]``.
        target_keys, reference_keys: bank keys per query head ``[H, M, D]``.
    Returns:
        margins ``[..., H, T]``.
    """
    best_target = torch.einsum("...htd,hmd->...htm", queries, target_keys).amax(-1)
    best_reference = torch.einsum("...htd,hmd->...htm", queries, reference_keys).amax(-1)
    return (best_target - best_reference) * scale


def unit_scores(alignment: torch.Tensor, target_mass: torch.Tensor, prompt_mass: torch.Tensor,
                *, xi: float, chi: float) -> torch.Tensor:
    """Eq. 11: U = ā + ξ·m̄⁺ − χ·m̄^x, elementwise over ``[layers, units]``."""
    return alignment + xi * target_mass - chi * prompt_mass


def select_sites(scores: torch.Tensor, *, top_units: int, top_layers: int,
                 aggregate: str = "sum", tie_break: torch.Tensor | None = None,
                 ) -> tuple[list[int], dict[int, list[int]], torch.Tensor]:
    """Eq. 12 on a ``[layers, units]`` table of ranking values.

    Returns ``(layer rows, units per layer row, layer scores)``: the top-``top_layers`` rows by the
    sum or mean of their top-``top_units`` unit values, in descending layer-score order. Equal
    values are ordered by ``tie_break`` (same shape, aggregated the same way), then by index.
    """
    if aggregate not in ("sum", "mean"):
        raise ValueError(f"aggregate must be 'sum' or 'mean', got {aggregate!r}")
    rows, units = scores.shape
    if not 1 <= top_units <= units:
        raise ValueError(f"top_units must be in [1, {units}], got {top_units}")
    if not 1 <= top_layers <= rows:
        raise ValueError(f"top_layers must be in [1, {rows}], got {top_layers}")
    tie = torch.zeros_like(scores) if tie_break is None else tie_break.to(scores.dtype)

    def ranked(values: torch.Tensor, ties: torch.Tensor) -> list[int]:
        return sorted(range(len(values)), key=lambda i: (-float(values[i]), -float(ties[i]), i))

    kept = {row: sorted(ranked(scores[row], tie[row])[:top_units]) for row in range(rows)}
    layer_scores = torch.stack([scores[row, kept[row]].sum() for row in range(rows)])
    layer_ties = torch.stack([tie[row, kept[row]].sum() for row in range(rows)])
    if aggregate == "mean":
        layer_scores, layer_ties = layer_scores / top_units, layer_ties / top_units
    chosen = ranked(layer_scores, layer_ties)[:top_layers]
    return chosen, {row: kept[row] for row in chosen}, layer_scores


@torch.no_grad()
def calibrate_by_attention(
    model: nn.Module,
    tokenizer,
    banks: BankSet,
    prompts: Sequence[str],
    *,
    top_layers: int = 5,
    top_units: int = 1,
    unit_type: str = "auto",
    candidate_layers: Sequence[int] | None = None,
    xi: float = 1.0,
    chi: float = 1.0,
    aggregate: str = "sum",
    layer_gains: str = "uniform",
    order: str = "alignment",
    positions: str = "user",
    chat_template: bool = True,
    batch_size: int = 4,
    progress: bool = True,
    config: AttentionConfig | None = None,
) -> SelectionResult:
    """Algorithm 1: score every candidate unit on ``prompts`` and pick the best sites; returns
    the :class:`~hf_memory.selection.selector.Selector` fields.

    This is the paper's *diagnostic* selector. On the embedded SmolLM2-135M it picks sites
    where the banks take attention but do not steer (measured in BENCHMARKS.md);
    :meth:`~hf_memory.selection.selector.Selector.calibrate_behavioural` picks sites by the
    movement they cause, and is what the evaluation and the demo use by default.

    Args:
        banks: a bank set with a target and a reference bank (auxiliary banks take part in
            the routing like at steering time).
        prompts: calibration prompts (wrapped in the chat template unless told otherwise).
        top_layers, top_units: the budgets m and k.
        unit_type: ``"head"``, ``"kv_group"``, or ``"auto"`` (KV groups for grouped-query
            models, heads for dense ones).
        xi, chi: weights of target mass and prompt mass in eq. 11.
        aggregate: ``"sum"`` or ``"mean"`` over a layer's top units (eq. 12).
        layer_gains: ``"uniform"`` (ρ = 1) or ``"relative"`` (ρ_ℓ = U_ℓ / max U over the
            selected layers, clipped to [0, 1]).
        order: ``"alignment"`` ranks units and layers by ā, with U of eq. 11 as the
            tie-break (appendix C: the dense questionnaire calibration orders primarily by
            ā); ``"score"`` ranks by U itself.
        positions: ``"user"`` averages the statistics over the user's text and the
            assistant prefix only (not the chat template's system prompt); ``"all"`` over
            every non-padding position.
        config: the knobs above as one :class:`~hf_memory.selection.search_types.AttentionConfig`,
            instead of the keywords.

    Returns:
        A :class:`~hf_memory.selection.search_types.SelectionResult` (a read-only mapping of
        the selector fields).
    """
    search = config_from(config, AttentionConfig,
                         {name: value for name, value in locals().items()
                          if name in _KEYWORDS}, _KEYWORDS)
    scoring, top_layers, top_units = search.scoring, search.top_layers, search.top_units
    xi, chi, aggregate, order = scoring.xi, scoring.chi, scoring.aggregate, scoring.order
    layer_gains, positions, chat_template = (scoring.layer_gains, search.positions,
                                             search.chat_template)
    unit_type, batch_size = search.unit_type, search.batch_size
    model_config = model.config
    adapter = get_adapter(model)
    roles = [bank.role for bank in banks]
    if "target" not in roles or "reference" not in roles:
        raise ValueError("calibration needs a target and a reference bank")
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise ValueError("calibration needs a non-empty list of non-empty prompts")
    if order not in ("alignment", "score"):
        raise ValueError(f"order must be 'alignment' or 'score', got {order!r}")
    if positions not in ("user", "all"):
        raise ValueError(f"positions must be 'user' or 'all', got {positions!r}")
    if layer_gains not in ("uniform", "relative"):
        raise ValueError(f"layer_gains must be 'uniform' or 'relative', got {layer_gains!r}")
    if unit_type == "auto":
        grouped = model_config.num_key_value_heads < model_config.num_attention_heads
        unit_type = "kv_group" if grouped else "head"
    if unit_type not in ("head", "kv_group"):
        raise ValueError(f"unit_type must be 'head', 'kv_group' or 'auto', got {unit_type!r}")
    target, reference = (next(b for b in banks if b.role == role)
                         for role in ("target", "reference"))
    covered = sorted(set(target.layers) & set(reference.layers))
    candidates = (covered if search.candidate_layers is None
                  else sorted(set(search.candidate_layers)))
    missing = sorted(set(candidates) - set(covered))
    if missing or not candidates:
        raise ValueError(f"candidate layers {missing or candidates} are not covered by both "
                         "the target and the reference bank")
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    group = heads // kv_heads
    device = next(model.parameters()).device
    target_col, reference_col = 1 + roles.index("target"), 1 + roles.index("reference")

    sums = {name: torch.zeros(len(candidates), heads, dtype=torch.float64)
            for name in DIAGNOSTICS[:4]}
    count = 0
    texts = [tokenizer.apply_chat_template(chat_messages(p), add_generation_prompt=True,
                                           tokenize=False) if chat_template else p
             for p in prompts]
    skipped = [_tokens_before(tokenizer, text, prompt)
               if chat_template and positions == "user" else 0
               for text, prompt in zip(texts, prompts, strict=True)]
    query_modules = {f"q{layer}": getattr(adapter.attention(model, layer),
                                          adapter.query_module) for layer in candidates}
    bank_keys = {}
    for layer in candidates:
        bank_keys[layer] = [
            bank.keys[bank.layer_index(layer)].to(device=device, dtype=torch.float64)
            .repeat_interleave(group, dim=0) for bank in (target, reference)]
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batches = range(0, len(texts), batch_size)
        for start in tqdm(batches, desc="calibrating", disable=not search.progress):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt",
                              padding=True, add_special_tokens=False).to(device)
            valid = batch["attention_mask"].bool()
            offsets = torch.tensor(skipped[start:start + batch_size], device=device)
            valid &= (valid.long().cumsum(-1) - 1) >= offsets[:, None]
            with steer(model, banks, layers=candidates, trace_only=True) as handle, \
                    capture_outputs(query_modules) as captured:
                handle.record_routing()
                model(**batch, use_cache=False)
                routing = handle.routing()
            weights = valid[:, None, :].to(torch.float64)
            for row, layer in enumerate(candidates):
                q = adapter.query(captured[f"q{layer}"], model.config).to(torch.float64)
                margin = alignment_margin(q, *bank_keys[layer],
                                          scale=adapter.attention(model, layer).scaling)
                (pi,) = routing[layer]
                pi = pi.to(torch.float64)
                for name, value in (("alignment", margin), ("target_mass", pi[..., target_col]),
                                    ("reference_mass", pi[..., reference_col]),
                                    ("prompt_mass", pi[..., 0])):
                    sums[name][row] += (value * weights).sum(dim=(0, 2)).cpu()
            count += int(valid.sum())
    finally:
        tokenizer.padding_side = previous_side

    per_head = {name: total / count for name, total in sums.items()}
    if unit_type == "kv_group":
        per_unit = {k: v.view(len(candidates), kv_heads, group).mean(-1)
                    for k, v in per_head.items()}
    else:
        per_unit = per_head
    scores = unit_scores(per_unit["alignment"], per_unit["target_mass"],
                         per_unit["prompt_mass"], xi=xi, chi=chi)
    ranking, tie_break = ((per_unit["alignment"], scores) if order == "alignment"
                          else (scores, None))
    rows, units, layer_scores = select_sites(ranking, top_units=top_units,
                                             top_layers=top_layers, aggregate=aggregate,
                                             tie_break=tie_break)
    layers = sorted(candidates[row] for row in rows)
    chosen_units = {candidates[row]: units[row] for row in rows}
    if layer_gains == "uniform":
        gains = {layer: 1.0 for layer in layers}
    else:
        best = max(float(layer_scores[row]) for row in rows)
        gains = {candidates[row]: (min(1.0, max(0.0, float(layer_scores[row]) / best))
                                   if best > 0 else 1.0) for row in rows}
    prompts_hash = hashlib.sha256("\x00".join(prompts).encode()).hexdigest()
    return SelectionResult(
        layers=layers, units=dict(sorted(chosen_units.items())), unit_type=unit_type,
        layer_gains=dict(sorted(gains.items())), candidate_layers=list(candidates),
        diagnostics={**{k: v.to(torch.float32) for k, v in per_unit.items()},
                     "score": scores.to(torch.float32)},
        config={"objective": "diagnostic", "order": order, "positions": positions,
                "top_layers": top_layers, "top_units": top_units, "xi": xi, "chi": chi,
                "aggregate": aggregate, "layer_gains": layer_gains,
                "chat_template": chat_template, "num_prompts": len(prompts),
                "num_positions": count, "prompts_sha256": prompts_hash,
                "banks": banks.audit(), "layer_scores": layer_scores.tolist()},
        fingerprint=model_fingerprint(model))


_KEYWORDS = keyword_defaults(calibrate_by_attention)


def _tokens_before(tokenizer, text: str, prompt: str) -> int:
    """How many tokens of templated ``text`` come before the user's ``prompt`` in it."""
    offset = text.rfind(prompt)
    if offset < 0:
        raise ValueError("the chat template does not render the prompt verbatim; calibrate "
                         "with positions='all'")
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    return sum(1 for a, b in encoded["offset_mapping"] if b <= offset or (a < offset < b))
