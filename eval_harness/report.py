"""Tables (Markdown) and plots (PNG) from a results JSON, for a person to look at."""

from __future__ import annotations

import json
from pathlib import Path

from .names import FAMILY_TASKS

__all__ = ["render_report"]


def render_report(results_path: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write ``report.md`` and PNG plots next to (or into ``out`` for) a results JSON."""
    path = Path(results_path)
    if path.is_dir():
        path = path / "results.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read results from {path}: {error}") from None
    out = Path(out) if out is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    task = record.get("task")
    if task == "trait-steering":
        from .trait_steering.report import render_trait_steering

        return render_trait_steering(record, out)
    if task == "layer-ablation":
        from .trait_steering.report import render_layer_ablation

        return render_layer_ablation(record, out)
    if task == "kv-footprint":
        from .kv_footprint.report import render_kv_footprint

        return render_kv_footprint(record, out)
    if task == "ffn-memories":
        from .ffn_memories.report import render_ffn_memories

        return render_ffn_memories(record, out)
    if task == "persistence":
        from .persistence.report import render_persistence

        return render_persistence(record, out)
    if task == "guidance":
        from .guidance.report import render_guidance

        return render_guidance(record, out)
    if task == "dialogue-shift":
        from .dialogue_shift.report import render_dialogue_shift

        return render_dialogue_shift(record, out)
    if task == "tradeoff":
        from .tradeoff.report import render_tradeoff

        return render_tradeoff(record, out)
    if task == "capability":
        from .capability.report import render_capability

        return render_capability(record, out)
    if task == "asm-refinement":
        from .asm_refinement.report import render_asm_refinement

        return render_asm_refinement(record, out)
    if task == "persona-ab":
        from .persona_ab.report import render_persona_ab

        return render_persona_ab(record, out)
    if task == "lm-eval":
        from .lm_eval_model.report import render_lm_eval

        return render_lm_eval(record, out)
    if task in FAMILY_TASKS:
        from .family.report import render_family_report

        return render_family_report(record, out)
    if task in ("bigfive", "bigfive-gen"):
        from .bigfive.report import render_bigfive

        return render_bigfive(record, out)
    raise ValueError(f"{path} holds results of an unknown task {task!r}")
