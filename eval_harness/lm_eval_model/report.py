"""The report of an ``lm-eval`` results file: every task's metrics with lm-eval's standard
errors, the steering applied (with its artifacts' hashes), and one bar plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_lm_eval"]


def _steering(steering: dict[str, Any]) -> str:
    method = steering["method"]
    if method == "memory":
        banks = ", ".join(f"{b['name']} ({b['role']}, gain {b['gain']}, {b['content_hash'][:12]})"
                          for b in steering["banks"])
        return f"memory inception: banks {banks}; sites {steering['sites']}"
    if method == "caa":
        return (f"CAA at layers {steering['layers']}, scale {steering['scale']}, vectors "
                f"{steering['vectors_sha256'][:12]}")
    if method == "prompt":
        return f"prompt ({steering['placement']}): {steering['text']!r}"
    return "plain"


def render_lm_eval(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``lm_eval.png`` into ``out``; return their paths."""
    results = record["results"]
    lines = ["| task | metric | value | stderr |", "| --- | --- | --- | --- |"]
    names, values, errors = [], [], []
    for task, row in results["results"].items():
        for key, value in row.items():
            if "_stderr" in key:
                continue
            metric, _, filt = key.partition(",")
            stderr = row.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            lines.append(f"| {task} | {metric}{'' if filt in ('', 'none') else f' ({filt})'} | "
                         f"{value:.4f} | {'—' if stderr is None else f'{stderr:.4f}'} |")
            names.append(f"{task}\n{metric}")
            values.append(value)
            errors.append(stderr or 0.0)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(names)), 3.2), layout="constrained")
    ax.bar(range(len(names)), values, yerr=errors, color="#4c72b0", capsize=3)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("score")
    ax.set_title(f"lm-eval, {results['steering']['method']}", fontsize=9)
    plot = save_figure(fig, out / "lm_eval.png")
    report = out / "report.md"
    report.write_text(
        f"# lm-evaluation-harness\n\nModel `{record['model']['name_or_path']}`, lm-eval "
        f"{results['lm_eval_version']}, {record['wall_time_s']:.0f} s, git "
        f"{record['environment']['git_sha']}.\n\nSteering: {_steering(results['steering'])}.\n\n"
        + "\n".join(lines) + f"\n\n![lm-eval]({plot.name})\n")
    return [report, plot]
