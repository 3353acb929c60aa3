"""The report of a ``tradeoff`` results file: one Pareto plot per direction (trait shift against
ΔNLL per token of neutral text) and the tables of shift at matched cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_tradeoff"]

_COLORS = {"memory": "#4c72b0", "caa": "#55a868", "prompt": "#dd8452"}


def _plot(direction: dict[str, Any], limit: float, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(4.2, 3.2), layout="constrained")
    ax.scatter([0.0], [0.0], color="black", marker="x", label="plain")
    for family, color in _COLORS.items():
        mine = sorted((p for p in direction["points"] if p["family"] == family),
                      key=lambda p: p["strength"])
        xs, ys = [p["delta_nll"] for p in mine], [p["trait_shift"] for p in mine]
        ax.plot(xs, ys, marker="o", color=color, label=family,
                linestyle="-" if len(mine) > 1 else "none")
        for p in mine:
            ax.annotate(f"{p['strength']:g}", (p["delta_nll"], p["trait_shift"]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
    ax.axvline(limit, color="grey", linestyle=":", linewidth=1)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel("ΔNLL per token, neutral text (nats)")
    ax.set_ylabel("trait shift, held-out pairs (nats)")
    ax.set_title(direction["direction"])
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def _cell(row: dict[str, Any], family: str) -> str:
    low, high = row["shift_ci"][family]
    name = row[family] or "none fits"
    return f"{row['shift'][family]:+.2f} [{low:+.2f}, {high:+.2f}] ({name})"


def _table(directions: list[dict[str, Any]], key: str) -> str:
    lines = ["| direction | memory | CAA | prompt | memory − CAA | memory − prompt |",
             "| --- | --- | --- | --- | --- | --- |"]
    for d in directions:
        row = d["matched"][key]
        diffs = " | ".join(
            f"{row[f'memory_minus_{o}']:+.2f} [{row[f'memory_minus_{o}_ci'][0]:+.2f}, "
            f"{row[f'memory_minus_{o}_ci'][1]:+.2f}]" for o in ("caa", "prompt"))
        lines.append(f"| {d['direction']} | " + " | ".join(_cell(row, f) for f in
                                                           ("memory", "caa", "prompt"))
                     + f" | {diffs} |")
    return "\n".join(lines)


def render_tradeoff(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``tradeoff_<direction>.png`` into ``out``; return their paths."""
    results = record["results"]
    config, directions = results["config"], results["directions"]
    plots = [_plot(d, config["max_delta_nll"],
                   out / f"tradeoff_{d['direction'].replace('+', 'plus').replace('-', 'minus')}"
                   ".png") for d in directions]
    summary = results["summary"]
    points = "\n".join(
        f"| {d['direction']} | {p['name']} | {p['trait_shift']:+.2f} "
        f"[{p['trait_shift_ci'][0]:+.2f}, {p['trait_shift_ci'][1]:+.2f}] | "
        f"{p['delta_nll']:+.4f} | {p['retention']:.3f} |"
        for d in directions for p in d["points"])
    counts = "; ".join(
        f"{label}: memory ahead of CAA in {s['memory_ahead_of_caa']} of {s['directions']}, of "
        f"the prompt in {s['memory_ahead_of_prompt']} (mean shift memory "
        f"{s['mean_shift']['memory']:+.2f}, CAA {s['mean_shift']['caa']:+.2f}, prompt "
        f"{s['mean_shift']['prompt']:+.2f})"
        for label, s in ((f"ΔNLL ≤ {config['max_delta_nll']:g}", summary["delta_nll"]),
                         (f"retention ≥ {config['min_retention']:g}", summary["retention"])))
    text = "\n\n".join([
        "# Steering trade-off: trait shift against cost",
        f"Model `{record['model']['name_or_path']}`; {results['questions']['kept']} capability "
        f"questions the plain model answers; {results['neutral']['sentences']} neutral "
        f"sentences ({results['neutral']['tokens']} tokens). {counts}.",
        f"## Shift at matched cost: ΔNLL ≤ {config['max_delta_nll']:g} nats/token\n\n"
        + _table(directions, "delta_nll"),
        f"## Shift at matched cost: retention ≥ {config['min_retention']:g}\n\n"
        + _table(directions, "retention"),
        "## Every point\n\n| direction | method | trait shift [95 % CI] | ΔNLL/token | "
        "retention |\n| --- | --- | --- | --- | --- |\n" + points,
        "\n".join(f"![{d['direction']}]({p.name})" for d, p in zip(directions, plots,
                                                                    strict=True))])
    report = out / "report.md"
    report.write_text(text + "\n")
    return [report, *plots]
