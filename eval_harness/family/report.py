"""The report of an ``air-sudoku`` / ``air-maze`` / ``arith-splits`` results file: a table of
every metric and a bar chart of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_family_report"]


def render_family_report(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``metrics.png`` into ``out``; return their paths."""
    results, model = record["results"], record["model"]
    metrics = results["metrics"]
    rows = [f"| {name} | {value:.4f} |" for name, value in metrics.items()]
    if record["task"] == "asm-lm":
        return _asm_report(record, out)
    if record["task"] == "arith-splits":
        detail = (f"{results['pool_size']} sequences per pool; held-out pairs: "
                  f"{results['held_out_split']}")
        rows += ["", "| progress measure | value |", "| --- | --- |"]
        rows += [f"| {name} | {value:.4f} |" for name, value in results["progress"].items()]
    else:
        detail = (f"{results['puzzles']} held-out {results['board_size']}x"
                  f"{results['board_size']} puzzles ({results['data']['generator']}, split "
                  f"{results['data']['split']}, seed {results['data']['seed']})")
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(metrics) + 2), 3.2))
    accuracy = {k: v for k, v in metrics.items() if k != "mean_segments" and k != "count"}
    ax.bar(range(len(accuracy)), list(accuracy.values()), color="#4c72b0")
    ax.set_xticks(range(len(accuracy)), list(accuracy), rotation=45, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{record['task']}: {model['name_or_path']}", fontsize=9)
    plot = save_figure(fig, out / "metrics.png")
    report = out / "report.md"
    report.write_text(
        f"# {record['task']}\n\nModel `{model['name_or_path']}` ({model['model_type']}, "
        f"{model['num_parameters']:,} parameters, weights {model['weights_digest']}); {detail}; "
        f"{record['wall_time_s']:.1f} s on {record['environment'].get('device', '?')}.\n\n"
        "| metric | value |\n| --- | --- |\n" + "\n".join(rows) + f"\n\n![metrics]({plot.name})\n")
    return [report, plot]


def _asm_report(record: dict[str, Any], out: Path) -> list[Path]:
    results, model = record["results"], record["model"]
    metrics, geometry = results["metrics"], results["geometry"]
    fig, axes = plt.subplots(1, len(geometry), figsize=(3.0 * len(geometry), 2.8))
    for ax, (name, values) in zip(axes, geometry.items(), strict=True):
        ax.plot(range(len(values)), values, marker="o")
        ax.set_title(name.replace("_", " "), fontsize=9)
        ax.set_xlabel("layer")
    plot = save_figure(fig, out / "geometry.png")
    rows = "\n".join(f"| {layer} | " + " | ".join(f"{geometry[n][layer]:.3f}" for n in geometry)
                     + " |" for layer in range(len(next(iter(geometry.values())))))
    report = out / "report.md"
    report.write_text(
        f"# asm-lm\n\nModel `{model['name_or_path']}` ({model['num_parameters']:,} parameters, "
        f"weights {model['weights_digest']}) on {results['sentences']} sentences of "
        f"{results['corpus']}; {record['wall_time_s']:.1f} s on "
        f"{record['environment'].get('device', '?')}.\n\n| metric | value |\n| --- | --- |\n"
        f"| perplexity | {metrics['perplexity']:.3f} |\n"
        f"| NLL per token | {metrics['nll_per_token']:.4f} |\n| tokens | {metrics['tokens']} |"
        f"\n\nRefinement geometry per layer (section 4), means over real tokens and heads:\n\n"
        f"| layer | {' | '.join(geometry)} |\n|{' --- |' * (len(geometry) + 1)}\n{rows}\n\n"
        f"![geometry]({plot.name})\n")
    return [report, plot]
