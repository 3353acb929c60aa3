"""The report of a ``persona-ab`` results file: per set and method the propensity shift with its
interval, mcq_acc, steerability, wrong-way fraction and cost; the shift at matched cost; the
frozen setups; and one plot of shift against cost per set."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_persona_ab"]

METHODS = ("prompt", "caa", "memory")
_COLORS = {"memory": "#4c72b0", "caa": "#55a868", "prompt": "#dd8452"}


def _ci(value: float, interval: list[float], digits: int = 3) -> str:
    low, high = interval
    return f"{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _plot(sets: list[dict[str, Any]], budget: float, path: Path) -> Path:
    columns = min(4, len(sets))
    rows = math.ceil(len(sets) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.3 * columns, 2.7 * rows), squeeze=False,
                             layout="constrained")
    for ax, entry in zip(axes.flat, sets, strict=False):
        ax.scatter([0.0], [0.0], color="black", marker="x", zorder=3, label="plain")
        for method in METHODS:
            points = sorted(entry["methods"][method]["points"], key=lambda p: p["dial"])[1:]
            xs, ys = [p["cost"] for p in points], [p["shift"] for p in points]
            errors = [[p["shift"] - p["shift_ci"][0] for p in points],
                      [p["shift_ci"][1] - p["shift"] for p in points]]
            ax.errorbar(xs, ys, yerr=errors, marker="o", markersize=3, capsize=2,
                        color=_COLORS[method], label=method,
                        linestyle="-" if len(points) > 1 else "none")
        ax.axvline(budget, color="grey", linestyle=":", linewidth=1)
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_title(entry["set"], fontsize=8)
        ax.tick_params(labelsize=6)
    for ax in axes.flat[len(sets):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("propensity shift (nats)", fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("ΔNLL/token, neutral text", fontsize=7)
    axes[0][0].legend(fontsize=6)
    return save_figure(fig, path)


def render_persona_ab(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``persona_ab.png`` into ``out``; return their paths."""
    results = record["results"]
    config, sets, summary = results["config"], results["sets"], results["summary"]
    budget = config["cost_budget"]
    plot = _plot(sets, budget, out / "persona_ab.png")
    overview = ["| method | shift at dial 1 | sets CI > 0 / < 0 | shift at matched cost | "
                "sets fitting / CI > 0 | steerability | wrong-way | mcq_acc | cost |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                f"| plain | — | — | — | — | — | — | {summary['plain_mcq_acc']:.3f} | — |"]
    for method in METHODS:
        s = summary[method]
        overview.append(
            f"| {method} | {s['shift']:+.3f} | {s['above_zero']} / {s['below_zero']} | "
            f"{s['matched_shift']:+.3f} | {s['matched_fits']} / {s['matched_above_zero']} | "
            f"{s['steerability']:+.3f} "
            f"| {s['wrong_way_fraction']:.2f} | {s['mcq_acc']:.3f} | {s['cost']:+.4f} |")
    table = ["| set | method | mean propensity | shift [95 % CI] | mcq_acc | steerability "
             "[95 % CI] | wrong-way | cost (ΔNLL/tok) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    matched = ["| set | " + " | ".join(METHODS) + " |", "| --- |" + " --- |" * len(METHODS)]
    setups = ["| set | CAA layer | CAA scale | memory layers | memory strength | memory "
              "units |", "| --- | --- | --- | --- | --- | --- |"]
    for entry in sets:
        plain = entry["plain"]
        table.append(f"| {entry['set']} | plain | {plain['mean_propensity']:+.3f} | — | "
                     f"{plain['mcq_acc']:.3f} | — | — | 0 |")
        cells = []
        for method in METHODS:
            m = entry["methods"][method]
            c = m["calibrated"]
            table.append(f"| | {method} | {c['mean_propensity']:+.3f} | "
                         f"{_ci(c['shift'], c['shift_ci'])} | {c['mcq_acc']:.3f} | "
                         f"{_ci(m['steerability'], m['steerability_ci'])} | "
                         f"{m['wrong_way_fraction']:.2f} | {c['cost']:+.4f} |")
            mm = m["matched"]
            cells.append(f"{_ci(mm['shift'], mm['shift_ci'])} (dial {mm['dial']:g}, cost "
                         f"{mm['cost']:+.3f})" if mm["fits"] else "none fits (0)")
        matched.append(f"| {entry['set']} | " + " | ".join(cells) + " |")
        caa, memory = entry["setup"]["caa"], entry["setup"]["memory"]
        units = sum(len(u) for u in memory["units"].values())
        setups.append(f"| {entry['set']} | {caa['layer']} | {caa['scale']:g} | "
                      f"{memory['layers']} | {memory['strength']:g} | {units} "
                      f"{memory['unit_type']}s |")
    dials = ", ".join(f"{d:g}" for d in config["dials"])
    text = "\n\n".join([
        "# Persona A/B steering (steering-bench's sets)",
        f"Model `{record['model']['name_or_path']}`; {len(sets)} sets; per set "
        f"{config['calibration_items']} calibration and {config['heldout_items']} disjoint "
        f"held-out items (seed {record['seed']}); cost budget {budget:g} nats/token of neutral "
        f"text ({results['cost_text']['tokens']} tokens); wall time "
        f"{record['wall_time_s']:.0f} s on {record['environment'].get('device', '?')}"
        + (f" ({len(results['resumed'])} sets resumed from the checkpoint; the sets' own "
           f"times sum to {results['sets_wall_time_s']:.0f} s)" if results.get("resumed")
           else "") + f"; git {record['environment']['git_sha']}.",
        "Propensity = log p(positive answer) − log p(negative answer) (nats); shift = "
        "propensity − plain per held-out item, 95 % bootstrap interval over items. Dial 1 is "
        f"each method's calibrated point; CAA and memory are scored at dials {dials} "
        "(CAA: multiple of the calibrated scale; memory: the strength, a multiple of the "
        "selector's), the prompt at 0 and 1. Steerability = least-squares slope of mean "
        "propensity against the dial; wrong-way = share of items whose own slope is negative. "
        "Cost = ΔNLL per token of neutral text (the text the budget was calibrated on).",
        "## Over all sets (means)\n\n" + "\n".join(overview),
        "## Per set, at the calibrated point (dial 1)\n\n" + "\n".join(table),
        f"## Shift at matched cost (the largest shift among steered points costing ≤ "
        f"{budget:g}; picked on the held-out items, so it leans optimistic)\n\n"
        + "\n".join(matched),
        "## Frozen on the calibration split\n\n" + "\n".join(setups),
        f"![shift against cost]({plot.name})",
        f"Data: {results['source']}."])
    report = out / "report.md"
    report.write_text(text + "\n")
    return [report, plot]
