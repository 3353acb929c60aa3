"""The KV footprint's report: a table and a log-scale bar plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["render_kv_footprint"]


def render_kv_footprint(record: dict[str, Any], out: Path) -> list[Path]:
    """``report.md`` (bank bytes against prompt KV per trait) and ``kv_footprint.png``."""
    results = record["results"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    lines = ["| trait | banks | layers | slots | bank bytes | descriptor KV (all layers) | "
             "ratio | system-prompt KV | ratio |", "|" + " --- |" * 9]
    for r in rows:
        lines.append(f"| {r['trait']} | {r['banks']} | {r['layers']} | {r['bank_slots']} | "
                     f"{r['bank_bytes']:,} | {r['prompt_kv_bytes']:,} | {r['actual_ratio']:.2f}x | "
                     f"{r['system_prompt_kv_bytes']:,} | {r['system_prompt_ratio']:.2f}x |")
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['trait']}\n{'T' if r['banks'] == 'target bank' else 'T+R'}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["prompt_kv_bytes"] for r in rows], 0.4,
           label="descriptor as visible prompt (all layers)")
    ax.bar([i + 0.2 for i in x], [r["bank_bytes"] for r in rows], 0.4,
           label="memory bank (selected layers)")
    ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("KV bytes (log scale)")
    ax.set_title(f"KV footprint on {record['model']['name_or_path']}")
    ax.legend()
    fig.tight_layout()
    plot = out / "kv_footprint.png"
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    report = out / "report.md"
    report.write_text("# KV footprint\n\n" + "\n".join(lines) + "\n\n![kv](kv_footprint.png)\n")
    return [report, plot]
