"""The FFN key-value memory analysis's report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["render_ffn_memories"]


def render_ffn_memories(record: dict[str, Any], out: Path) -> list[Path]:
    """The FFN key-value memory analysis: the per-layer table and the paper's figures."""
    from hf_memory.analysis.plots import plot_all

    results = record["results"]
    plots = plot_all(results, out)
    rates, cases = results["agreement"]["+"], results["cases"]
    rows = "\n".join(
        f"| {layer + 1} | {100 * rates['top1'][i]:.2f} | {100 * rates['any'][i]:.2f} | "
        f"{100 * results['active_fraction'][i]:.1f} | {100 * cases['residual'][i]:.1f} | "
        f"{100 * cases['ffn'][i]:.1f} | {100 * cases['agreement'][i]:.1f} | "
        f"{100 * cases['composition'][i]:.1f} |" for i, layer in enumerate(results["layers"]))
    report = out / "report.md"
    report.write_text(
        f"# FFN layers as key-value memories\n\nModel `{record['model']['name_or_path']}`; "
        f"{results['corpus']['sentences']} sentences ({results['corpus']['source']}), "
        f"{record['wall_time_s']:.0f} s.\n\n| layer | agree@1 % | agree@k % | active % | "
        "residual % | ffn % | agreement % | composition % |\n|" + " --- |" * 8 + f"\n{rows}\n\n"
        + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n")
    return [report, *plots]
