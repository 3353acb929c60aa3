"""The paper's figures 2, 4, 5, 7, 8, 9 and 11 as PNGs, drawn from an analysis results dict.

Layers are numbered from 1 on the x-axes, as in the paper. Figure 2 shows our automatic proxy
(shared-last-token share of the trigger prefixes), not the paper's human annotation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["FIGURES", "plot_all"]

FIGURES = ("fig2_shallow_triggers", "fig4_agreement", "fig5_target_rank", "fig7_active_memories",
           "fig8_zero_agreement", "fig9_residual_final", "fig11_composition_cases")
CASE_COLOURS = {"residual": "#4c72b0", "agreement": "#55a868", "ffn": "#dd8452",
                "composition": "#c44e52", "other": "#8c8c8c"}


def _axes(title: str, ylabel: str, results: dict[str, Any]):
    figure, axes = plt.subplots(figsize=(7, 4), dpi=120)
    axes.set_title(f"{title}\n{results['model']['name']}, {results['corpus']['sentences']} "
                   "sentences", fontsize=10)
    axes.set_xlabel("layer")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    return figure, axes


def _save(figure, directory: Path, name: str) -> Path:
    path = directory / f"{name}.png"
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def plot_all(results: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write every figure of ``FIGURES`` into ``directory``; returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    x = [layer + 1 for layer in results["layers"]]
    k = results["config"]["top_k"]
    paths = []

    figure, axes = _axes("Fig. 2 (proxy): trigger prefixes sharing their last token (>= 3 of "
                         f"top-{k})", "share of trigger prefixes", results)
    axes.bar(x, results["shallow_trigger_share"], color="#4c72b0")
    paths.append(_save(figure, directory, FIGURES[0]))

    figure, axes = _axes("Fig. 4: value top token = next token of the key's triggers",
                         "agreement rate (%)", results)
    for polarity, style in (("+", "-"), ("-", ":")):
        rates = results["agreement"].get(polarity)
        if rates is None:
            continue
        axes.plot(x, [100 * v for v in rates["top1"]], "o" + style, color="#c44e52",
                  label=f"top-1 trigger ({polarity})")
        axes.plot(x, [100 * v for v in rates["any"]], "s" + style, color="#4c72b0",
                  label=f"any of top-{k} triggers ({polarity})")
        axes.plot(x, [100 * v for v in rates["baseline_any"]], style, color="#8c8c8c",
                  label=f"baseline, any ({polarity})")
    axes.legend(fontsize=8)
    paths.append(_save(figure, directory, FIGURES[1]))

    figure, axes = _axes("Fig. 5: rank of the top-1 trigger target in the value's distribution",
                         "median rank (0 = top)", results)
    for polarity, style in (("+", "o-"), ("-", "o:")):
        if polarity in results["agreement"]:
            axes.plot(x, results["agreement"][polarity]["median_target_rank"], style,
                      label=f"polarity {polarity}")
    axes.axhline((results["model"]["vocab_size"] - 1) / 2, color="#8c8c8c", linestyle="--",
                 label="random token (median)")
    axes.set_yscale("log")
    axes.legend(fontsize=8)
    paths.append(_save(figure, directory, FIGURES[2]))

    threshold = results["config"]["active_threshold"]
    figure, axes = _axes(f"Fig. 7: active memories (|m_i| > {threshold} max|m|)",
                         "share of memories (%)", results)
    axes.plot(x, [100 * v for v in results["active_fraction"]], "o-", color="#55a868")
    paths.append(_save(figure, directory, FIGURES[3]))

    figure, axes = _axes("Fig. 8: zero-agreement rate (top(y) differs from every active memory)",
                         "share of prefixes (%)", results)
    axes.bar(x, [100 * v for v in results["zero_agreement_rate"]], color="#dd8452")
    axes.set_ylim(0, 100)
    paths.append(_save(figure, directory, FIGURES[4]))

    figure, axes = _axes("Fig. 9: residual's top token = model's final prediction",
                         "share of prefixes (%)", results)
    axes.plot(x, [100 * v for v in results["residual_matches_final"]], "o-", color="#4c72b0")
    axes.set_ylim(0, 100)
    paths.append(_save(figure, directory, FIGURES[5]))

    figure, axes = _axes("Fig. 11: where the layer's prediction top(o) comes from",
                         "share of prefixes (%)", results)
    bottom = [0.0] * len(x)
    for name, colour in CASE_COLOURS.items():
        shares = [100 * v for v in results["cases"][name]]
        if name == "other" and not any(shares):
            continue
        axes.bar(x, shares, bottom=bottom, color=colour, label=name)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    axes.set_ylim(0, 100)
    axes.legend(fontsize=8, loc="lower left")
    paths.append(_save(figure, directory, FIGURES[6]))
    return paths
