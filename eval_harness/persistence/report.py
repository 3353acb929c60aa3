"""The report of a ``persistence`` results file: shift over plain against the length of the
opposite-style history, per direction and method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_persistence"]

_COLORS = {"prompt": "#dd8452", "caa": "#55a868", "memory": "#4c72b0"}


def render_persistence(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``persistence.png`` into ``out``; return their paths."""
    curves = record["results"]["curves"]
    directions = list(dict.fromkeys(c["direction"] for c in curves))
    fig, axes = plt.subplots(1, len(directions), figsize=(4.6 * len(directions), 3.4),
                             squeeze=False, layout="constrained")
    for ax, direction in zip(axes[0], directions, strict=True):
        for method, color in _COLORS.items():
            mine = [c for c in curves if c["direction"] == direction and c["method"] == method]
            xs = [c["history_tokens"] for c in mine]
            ax.plot(xs, [c["shift"] for c in mine], marker="o", color=color, label=method)
            ax.fill_between(xs, [c["shift_ci"][0] for c in mine],
                            [c["shift_ci"][1] for c in mine], color=color, alpha=0.15)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xlabel("opposite-style history (tokens)")
        ax.set_title(direction, fontsize=9)
    axes[0][0].set_ylabel("margin shift over plain (nats)")
    axes[0][0].legend(fontsize=7)
    plot = save_figure(fig, out / "persistence.png")
    rows = "\n".join(
        f"| {c['direction']} | {c['history_tokens']} | {c['method']} | {c['margin']:+.3f} | "
        + (f"{c['shift']:+.3f} [{c['shift_ci'][0]:+.3f}, {c['shift_ci'][1]:+.3f}]"
           if c["method"] != "plain" else "—") + " |" for c in curves)
    report = out / "report.md"
    report.write_text(
        f"# persistence\n\nModel `{record['model'].get('name_or_path', '?')}`; "
        f"{record['wall_time_s']:.0f} s on {record['environment'].get('device', '?')}; "
        f"{record['results']['config']['items']} held-out items per direction. The prompt is "
        "set once, before the history; CAA and memory act on the whole conversation.\n\n"
        "| direction | history tokens | method | mean margin | shift over plain [95 % CI] |\n"
        f"| --- | --- | --- | --- | --- |\n{rows}\n\n![persistence]({plot.name})\n")
    return [report, plot]
