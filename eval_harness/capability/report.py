"""The report of a ``capability`` results file: retention and neutral-text ΔNLL per direction
and method, with intervals, and one plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_capability"]

_COLORS = {"prompt": "#dd8452", "caa": "#55a868", "memory": "#4c72b0"}
_SCALED = ("#6f8fc8", "#9db3dc", "#c6d4ec")  # memory at lower gains, lighter and lighter


def _shift(run: dict[str, Any]) -> str:
    if "trait_shift" not in run:  # results written before the trait shift was measured
        return "—"
    low, high = run["trait_shift_ci"]
    return f"{run['trait_shift']:+.2f} [{low:+.2f}, {high:+.2f}]"


def render_capability(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``capability.png`` into ``out``; return their paths."""
    results = record["results"]
    runs, questions = results["runs"], results["questions"]
    directions = list(dict.fromkeys(r["direction"] for r in runs))
    methods = list(dict.fromkeys(r["method"] for r in runs))
    colors = {**_COLORS, **dict(zip([m for m in methods if m not in _COLORS], _SCALED,
                                    strict=False))}
    fig, (keep, nll) = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        mine = {r["direction"]: r for r in runs if r["method"] == method}
        xs = [d + (i - (len(methods) - 1) / 2) * width for d in range(len(directions))]
        for ax, key in ((keep, "retention"), (nll, "delta_nll")):
            values = [mine[d][key] for d in directions]
            low = [v - mine[d][f"{key}_ci"][0] for v, d in zip(values, directions, strict=True)]
            high = [mine[d][f"{key}_ci"][1] - v for v, d in zip(values, directions, strict=True)]
            ax.bar(xs, values, width, yerr=[low, high], label=method, color=colors.get(method))
    for ax in (keep, nll):
        ax.set_xticks(range(len(directions)), directions)
        ax.axhline(1.0 if ax is keep else 0.0, color="black", linewidth=0.8)
    keep.set_ylabel("accuracy on questions plain answers (retention)")
    keep.set_ylim(0, 1.05)
    nll.set_ylabel("ΔNLL per token on neutral text (nats)")
    keep.legend(fontsize=7)
    plot = save_figure(fig, out / "capability.png")
    rows = "\n".join(
        f"| {r['direction']} | {r['method']} | {r['retention']:.3f} "
        f"[{r['retention_ci'][0]:.3f}, {r['retention_ci'][1]:.3f}] | "
        + ", ".join(f"{k} {v:.2f}" for k, v in r["retention_by_kind"].items())
        + f" | {r['delta_nll']:+.4f} [{r['delta_nll_ci'][0]:+.4f}, {r['delta_nll_ci'][1]:+.4f}]"
        f" | {r['perplexity_ratio']:.3f} | " + _shift(r) + " |" for r in runs)
    summary = "\n".join(f"| {m} | {s['retention']:.3f} | {s['delta_nll']:+.4f} | "
                        f"{s['perplexity_ratio']:.3f} | "
                        f"{s.get('trait_shift', float('nan')):+.2f} |"
                        for m, s in results["summary"].items())
    neutral = results["neutral"]
    report = out / "report.md"
    report.write_text(
        f"# capability\n\nModel `{record['model'].get('name_or_path', '?')}`; "
        f"{record['wall_time_s']:.0f} s on {record['environment'].get('device', '?')}. "
        f"Questions generated: {questions['generated']}; the plain model answers "
        f"{questions['kept']} ({questions['kept_by_kind']}), which are kept, so plain retention "
        f"is 1. Neutral text: {neutral['sentences']} sentences ({neutral['tokens']} tokens), "
        f"plain NLL {neutral['plain_nll_per_token']:.3f} nats/token.\n\n"
        "| method | mean retention | mean ΔNLL | mean perplexity ratio | mean trait shift |\n"
        "| --- | --- | --- | --- | --- |\n"
        f"{summary}\n\n| direction | method | retention [95 % CI] | by kind | ΔNLL/token "
        "[95 % CI] | perplexity ratio | trait shift [95 % CI] |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n"
        f"{rows}\n\n![capability]({plot.name})\n")
    return [report, plot]
