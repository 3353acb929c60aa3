"""A persona's voice band: its descriptor as a ``prompt_like`` bank (the first token off it) at a
contiguous band of the upper layers, the band chosen by what users see — a reply judge fitted on
the persona's pairs scoring greedy replies — within a cost budget and a KV ceiling.

Why: the persona call's few sites, chosen for the likelihood of the pairs, move held-out answers
while the greedy replies' voice stays with the visible prompt. On the embedded model the pirate's
voice needs the descriptor at many consecutive upper layers: bands of 4–8 layers (0.13–0.27x the
prompt's KV) carried none of its words at any gain up to 2, while layers 14–29 at ρ 0.5 were
judged 0.76 against the prompt's 0.83 and plain's 0.20, at 0.53x the prompt's KV and below its
cost (docs/benchmarks/personas.md, "A voice band"). The bands tried end at the last layer and
start every second layer from a third of the depth: a guess from that measurement, not a result
of the paper, which steers at selected sites.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hf_memory.metrics.likelihood import ContrastPair, check_pairs

__all__ = ["BAND_GAINS", "band_starts", "voice_band"]

BAND_GAINS = (0.25, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0)  # ρ, ascending: cost grows with it


def band_starts(num_layers: int) -> list[int]:
    """First layers of the bands tried (each band runs to the last layer): every second layer
    from a third of the depth, leaving bands of at least a sixth of the depth (2 layers)."""
    return list(range(num_layers // 3, num_layers - max(2, num_layers // 6) + 1, 2))


def _dial(cost, method_at, budget: float, gains: Sequence[float]):
    """``(rho, cost)`` at the largest ρ of ``gains`` within ``budget`` (the scan stops at the
    first over it), or None."""
    found = None
    for rho in sorted(gains):
        spent = cost.measure(method_at(rho))
        if spent > budget:
            break
        found = (float(rho), spent)
    return found


def voice_band(model, tokenizer, text: str, pairs: Sequence[ContrastPair], prompts: Sequence[str],
               *, cost, budget: float, kv_ceiling: float | None = 1.0,
               gains: Sequence[float] = BAND_GAINS, max_new_tokens: int = 40
               ) -> dict[str, Any] | None:
    """The band of :func:`band_starts` whose greedy replies to ``prompts`` a reply judge fitted
    on ``pairs`` scores highest, each band at the largest ρ of ``gains`` whose cost on neutral
    text (``cost``, a :class:`~hf_memory.metrics.steering_cost.NeutralCost`) stays within
    ``budget``; bands whose banks hold more than ``kv_ceiling`` times ``text``'s KV as a visible
    prompt (None: no ceiling) are not tried. Returns ``{"layers", "rho", "cost", "judged",
    "kv_fraction", "judge", "prompts", "trials"}`` or None when no band fits; raises
    :class:`~hf_memory.metrics.reply_judge.JudgeTooWeakError` when the pairs give no judge."""
    from hf_memory.baselines.methods import MemoryMethod, generate_with
    from hf_memory.metrics.kv_accounting import kv_footprint
    from hf_memory.metrics.reply_judge import ReplyJudge
    from hf_memory.recipes.persona import persona_banks

    check_pairs(pairs)
    if isinstance(budget, bool) or not isinstance(budget, int | float) \
            or not math.isfinite(budget):
        raise ValueError(f"budget must be a finite number of nats per token, got {budget!r}")
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of questions to judge replies on")
    if kv_ceiling is not None and (isinstance(kv_ceiling, bool)
                                   or not isinstance(kv_ceiling, int | float)
                                   or not kv_ceiling > 0):
        raise ValueError(f"kv_ceiling is a fraction of the prompt's KV above 0, or None; got "
                         f"{kv_ceiling!r}")
    judge = ReplyJudge.fit(pairs)
    banks = persona_banks(model, tokenizer, text, recipe="prompt_like", sink_reads_banks=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    depth = model.config.num_hidden_layers
    trials, best = [], None
    for start in band_starts(depth):
        layers = list(range(start, depth))
        footprint = kv_footprint(model, banks, ids, layers=layers)
        fraction = footprint.bank_bytes / footprint.prompt_kv_bytes
        trial: dict[str, Any] = {"layers": [start, depth - 1], "kv_fraction": fraction}
        trials.append(trial)
        if kv_ceiling is not None and fraction > kv_ceiling:
            trial["skipped"] = f"{fraction:.2f}x the prompt's KV, over the ceiling"
            continue

        def method_at(rho: float, layers=layers):
            return MemoryMethod(banks, layers=layers, layer_gains=dict.fromkeys(layers, rho))

        dialled = _dial(cost, method_at, budget, gains)
        if dialled is None:
            trial["skipped"] = f"over the budget of {budget:.3f} at every gain"
            continue
        rho, spent = dialled
        replies = generate_with(method_at(rho), model, tokenizer, list(prompts),
                                max_new_tokens=max_new_tokens)
        trial.update(rho=rho, cost=spent, judged=judge.summary(replies)["judge_score"])
        if best is None or trial["judged"] > best["judged"]:
            best = trial
    if best is None:
        return None
    return {"layers": list(range(best["layers"][0], depth)), "rho": best["rho"],
            "cost": best["cost"], "judged": best["judged"], "kv_fraction": best["kv_fraction"],
            "judge": judge.as_dict(), "prompts": len(prompts), "trials": trials}
