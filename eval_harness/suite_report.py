"""One report for a suite of evaluations: every run's headline metrics side by side."""

from __future__ import annotations

import json
from pathlib import Path

from .figures import plt, save_figure

__all__ = ["render_suite_report"]

_SKIP = ("count", "tokens", "mean_segments")


def render_suite_report(paths: list[Path], out: Path) -> list[Path]:
    """``out/suite.md`` (a table per task: one row per model, one column per metric) and
    ``out/suite.png`` (the same as grouped bars, one panel per task)."""
    by_task: dict[str, list[tuple[str, dict[str, float]]]] = {}
    for path in paths:
        record = json.loads(Path(path).read_text())
        metrics = (record["results"].get("metrics") or {}) if isinstance(
            record["results"], dict) else {}
        name = f"{record['model']['name_or_path']} ({record['model']['weights_digest'][:8]})"
        by_task.setdefault(record["task"], []).append(
            (name, {k: float(v) for k, v in metrics.items() if k not in _SKIP}))
    sections = []
    fig, axes = plt.subplots(1, len(by_task), figsize=(5.0 * len(by_task), 3.4), squeeze=False)
    for ax, (task, rows) in zip(axes[0], by_task.items(), strict=True):
        names = sorted({k for _, metrics in rows for k in metrics})
        header = "| model | " + " | ".join(names) + " |\n|" + " --- |" * (len(names) + 1)
        lines = [f"| {model} | " + " | ".join(f"{m[k]:.4f}" if k in m else "–" for k in names)
                 + " |" for model, m in rows]
        sections.append(f"## {task}\n\n{header}\n" + "\n".join(lines))
        width = 0.8 / max(1, len(rows))
        for j, (model, metrics) in enumerate(rows):
            ax.bar([i + j * width for i in range(len(names))],
                   [metrics.get(k, 0.0) for k in names], width, label=model)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=45,
                      ha="right", fontsize=7)
        ax.set_title(task, fontsize=9)
        ax.legend(fontsize=6)
    plot = save_figure(fig, out / "suite.png")
    report = out / "suite.md"
    report.write_text("# Evaluation suite\n\n" + "\n\n".join(sections)
                      + f"\n\n![suite]({plot.name})\n")
    return [report, plot]
