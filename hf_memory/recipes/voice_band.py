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

Under a KV ceiling a band keeps fewer slots rather than fewer layers: the same slots at every
layer of the band, those the steered queries attend to most (:func:`slot_mass`), as many as fit.
On the embedded model the pirate's band 16–29 with 11 of its 23 slots (0.23x the prompt's KV) was
judged 0.77 against the prompt's 0.83 and 11 random slots' 0.68; no band of 4–8 layers with every
slot had voiced it at all (docs/benchmarks/personas.md, "Fewer slots, not fewer layers").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hf_memory.metrics.likelihood import ContrastPair, check_pairs

__all__ = ["BAND_GAINS", "BAND_PROMPTS", "band_banks", "band_prompts", "band_selector",
           "band_starts", "slot_mass", "voice_band"]

BAND_GAINS = (0.25, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0)  # ρ, ascending: cost grows with it
BAND_PROMPTS = 8  # questions the voice band's replies are judged on


def band_prompts(pairs, count: int = BAND_PROMPTS) -> list[str]:
    """The first ``count`` everyday questions that are neither a prompt of ``pairs`` nor one of
    the demo's: what a persona's voice band is judged on, so that neither the judge's pairs nor
    the demo's questions choose it."""
    from hf_memory.recipes.calibration_data import DEFAULT_PROMPTS, everyday_questions

    taken = {prompt for prompt, _, _ in pairs} | set(DEFAULT_PROMPTS)
    return [q for q in everyday_questions() if q not in taken][:count]


def band_starts(num_layers: int) -> list[int]:
    """First layers of the bands tried (each band runs to the last layer): every second layer
    from a third of the depth, leaving bands of at least a sixth of the depth (2 layers)."""
    return list(range(num_layers // 3, num_layers - max(2, num_layers // 6) + 1, 2))


def slot_mass(model, tokenizer, banks, pairs: Sequence[ContrastPair], layers: Sequence[int],
              *, batch_size: int = 8) -> torch.Tensor:
    """``[M]``: per slot of ``banks``' one bank, the attention the persona's replies give it
    when it steers ``layers`` at ρ 0 (its slots beside the conversation's keys, as a visible
    prompt's would be): each pair's target reply teacher-forced after its prompt, the routing
    per slot summed over the reply's tokens and ``layers``, averaged over query heads
    (``batch_size`` pairs per left-padded pass)."""
    from hf_memory.chat.generation import chat_messages
    from hf_memory.metrics.plain_states import left_padded
    from hf_memory.steering.handle import steer

    (bank,) = banks.banks
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = []
    for prompt, reply, _ in pairs:
        head = tokenizer.apply_chat_template(chat_messages(prompt), tokenize=False,
                                             add_generation_prompt=True)
        rows.append((tokenizer(head, add_special_tokens=False).input_ids,
                     tokenizer(reply, add_special_tokens=False).input_ids))
    mass = torch.zeros(bank.num_slots, dtype=torch.float64)
    with steer(model, banks, layers=list(layers),
               layer_gains=dict.fromkeys(layers, 0.0)) as handle, torch.no_grad():
        handle.record_routing(per_slot=True)
        for first in range(0, len(rows), batch_size):
            chunk = rows[first:first + batch_size]
            ids, mask, positions = left_padded([tuple(h + r) for h, r in chunk], pad, device)
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
            for (routing,) in handle.routing(clear=True).values():
                for i, (_, reply) in enumerate(chunk):  # the reply: the row's last tokens
                    if reply:
                        mass += routing[i, :, -len(reply):, 1:].sum(1).mean(0).double().cpu()
    return mass


def band_banks(banks, slots: Sequence[int] | None):
    """``banks`` (one ``prompt_like`` bank) with only ``slots`` of it (None: all)."""
    from hf_memory.banks.bank_set import BankSet

    if slots is None:
        return banks
    (bank,) = banks.banks
    return BankSet([bank.keep_slots(slots)], fingerprint=banks.fingerprint, gamma=banks.gamma,
                   size_normalize=banks.size_normalize, sink_reads_banks=banks.sink_reads_banks)


def band_selector(model, text: str, band: dict[str, Any]):
    """A band of :func:`voice_band` as a frozen selector: every query head of its layers at its
    ρ, so that ``steer(model, band_banks(...), selector=...)`` and ``hf-memory chat --selector``
    steer as the band was judged."""
    from hf_memory.models.fingerprint import model_fingerprint
    from hf_memory.selection.selector import Selector

    layers = list(band["layers"])
    heads = list(range(model.config.num_attention_heads))
    record = {k: band[k] for k in ("layers", "rho", "cost", "capability", "judged",
                                   "kv_fraction", "slots")}  # its bytes: config["kv_bytes"]
    return Selector(layers=layers, units={layer: heads for layer in layers}, unit_type="head",
                    layer_gains=dict.fromkeys(layers, float(band["rho"])),
                    candidate_layers=layers, fingerprint=model_fingerprint(model),
                    config={"objective": "voice_band", "voice_band": record,
                            "kv_bytes": band["kv_bytes"],
                            "bank_recipe": {"recipe": "prompt_like", "text": text,
                                            "exemplars": [], "sink_reads_banks": False,
                                            "slots": band["slots"]}})


def _dial(cost, method_at, budget: float, gains: Sequence[float], capability=None,
          capability_ceiling: float | None = None):
    """``(rho, cost, capability)`` at the largest ρ of ``gains`` within ``budget`` and, with a
    ``capability`` probe, within ``capability_ceiling`` (the scan stops at the first over
    either; capability None where not measured), or None."""
    found = None
    for rho in sorted(gains):
        method = method_at(rho)
        spent = cost.measure(method)
        if spent > budget:
            break
        lost = None if capability is None else capability.measure(method)
        if lost is not None and lost > capability_ceiling:
            break
        found = (float(rho), spent, lost)
    return found


def voice_band(model, tokenizer, text: str, pairs: Sequence[ContrastPair], prompts: Sequence[str],
               *, cost, budget: float, kv_ceiling: float | None = 1.0,
               gains: Sequence[float] = BAND_GAINS, max_new_tokens: int = 40,
               capability=None, capability_ceiling: float | None = None,
               progress: bool = False) -> dict[str, Any] | None:
    """The band of :func:`band_starts` whose greedy replies to ``prompts`` a reply judge fitted
    on ``pairs`` scores highest, each band at the largest ρ of ``gains`` whose cost on neutral
    text (``cost``, a :class:`~hf_memory.metrics.steering_cost.NeutralCost`) stays within
    ``budget``; a band whose banks hold more than ``kv_ceiling`` times ``text``'s KV as a visible
    prompt (None: no ceiling) keeps the slots of highest :func:`slot_mass` that fit, and is not
    tried when not one fits. Returns ``{"layers", "rho", "cost", "capability", "judged",
    "kv_fraction", "kv_bytes", "slots", "judge", "prompts", "trials"}`` (``slots``: the slot
    indices kept, None: all; the banks are :func:`band_banks`) or None when no band fits; raises
    :class:`~hf_memory.metrics.reply_judge.JudgeTooWeakError` when the pairs give no judge.
    ``capability`` (an :class:`~hf_memory.metrics.factual.AnswerCost`): a gain must also cost
    the factual answers no more than ``capability_ceiling`` nats each. ``progress``: a bar over
    the bands."""
    from tqdm.auto import tqdm

    from hf_memory.baselines.methods import MemoryMethod, generate_with
    from hf_memory.metrics.kv_accounting import kv_footprint
    from hf_memory.metrics.reply_judge import ReplyJudge
    from hf_memory.recipes.recipe_banks import persona_banks

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
    if capability is not None and (isinstance(capability_ceiling, bool) or not isinstance(
            capability_ceiling, int | float) or not math.isfinite(capability_ceiling)):
        raise ValueError(f"a capability probe needs a finite capability_ceiling, got "
                         f"{capability_ceiling!r}")
    judge = ReplyJudge.fit(pairs)
    banks = persona_banks(model, tokenizer, text, recipe="prompt_like", sink_reads_banks=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    depth, slots_of = model.config.num_hidden_layers, banks.banks[0].num_slots
    trials, best = [], None
    for start in tqdm(band_starts(depth), desc="voice band", unit="band", disable=not progress):
        layers = list(range(start, depth))
        footprint = kv_footprint(model, banks, ids, layers=layers)
        fraction = footprint.bank_bytes / footprint.prompt_kv_bytes
        trial: dict[str, Any] = {"layers": [start, depth - 1], "kv_fraction": fraction,
                                 "kv_bytes": footprint.bank_bytes, "slots": None}
        trials.append(trial)
        these = banks
        if kv_ceiling is not None and fraction > kv_ceiling:
            fit = int(kv_ceiling * footprint.prompt_kv_bytes // (footprint.bank_bytes // slots_of))
            if fit < 1:
                trial["skipped"] = (f"one slot at every layer is {fraction / slots_of:.3f}x "
                                    f"the prompt's KV, over the ceiling")
                continue
            kept = slot_mass(model, tokenizer, banks, pairs, layers).topk(fit).indices
            trial["slots"] = sorted(kept.tolist())
            these = band_banks(banks, trial["slots"])
            smaller = kv_footprint(model, these, ids, layers=layers)
            trial.update(kv_fraction=smaller.bank_bytes / smaller.prompt_kv_bytes,
                         kv_bytes=smaller.bank_bytes)

        def method_at(rho: float, layers=layers, these=these):
            return MemoryMethod(these, layers=layers, layer_gains=dict.fromkeys(layers, rho))

        dialled = _dial(cost, method_at, budget, gains, capability, capability_ceiling)
        if dialled is None:
            trial["skipped"] = f"over the budget of {budget:.3f} at every gain" + (
                "" if capability is None else " (or the capability ceiling)")
            continue
        rho, spent, lost = dialled
        replies = generate_with(method_at(rho), model, tokenizer, list(prompts),
                                max_new_tokens=max_new_tokens)
        trial.update(rho=rho, cost=spent, capability=lost,
                     judged=judge.summary(replies)["judge_score"])
        if best is None or trial["judged"] > best["judged"]:
            best = trial
    if best is None:
        return None
    return {"layers": list(range(best["layers"][0], depth)), "rho": best["rho"],
            "cost": best["cost"], "capability": best["capability"], "judged": best["judged"],
            "kv_fraction": best["kv_fraction"], "kv_bytes": best["kv_bytes"],
            "slots": best["slots"], "judge": judge.as_dict(), "prompts": len(prompts),
            "trials": trials}
