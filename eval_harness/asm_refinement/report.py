"""The report of an ``asm-refinement`` results file: the paper's figures 1-4 and the section-5
statistics as PNGs, with the tables and the measured claims in ``report.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_asm_refinement"]

_TITLES = {"alpha": "alpha = <gΔ, o> / ||o||²", "orthogonal_fraction": "||gΔ⊥|| / ||gΔ||",
           "relative_magnitude": "||gΔ|| / ||o||"}
_REFERENCE = {"alpha": 0.0, "orthogonal_fraction": 0.5, "relative_magnitude": 1.0}


def _bars(ax, histogram: dict[str, list[float]], color: str) -> None:
    edges, counts = histogram["edges"], histogram["counts"]
    widths = [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]
    ax.bar(edges[:-1], counts, width=widths, align="edge", color=color)


def _geometry_figure(geometry: dict[str, Any], out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(11, 3))
    for ax, (name, entry) in zip(axes, geometry.items(), strict=True):
        _bars(ax, entry["histogram"], "#4c72b0")
        ax.axvline(entry["median"], color="#c44e52", label=f"median {entry['median']:.2f}")
        ax.axvline(_REFERENCE[name], color="black", linestyle="--", linewidth=0.8)
        ax.set_title(_TITLES[name], fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(f"positions (of {geometry['alpha']['samples']:,})")
    return save_figure(fig, out / "geometry.png")


def _intervention_figure(interventions: dict[str, Any], out: Path) -> Path:
    fig, (overall, layers) = plt.subplots(1, 2, figsize=(10, 3.2))
    delta = {k: v for k, v in interventions["delta"].items() if k != "default"}
    overall.bar(list(delta), list(delta.values()), color=["#55a868", "#c44e52", "#8172b2"])
    overall.axhline(0, color="black", linewidth=0.8)
    overall.set_ylabel("ΔNLL vs default (nats/token)")
    overall.set_title("every layer", fontsize=9)
    for mode, row in interventions["per_layer_delta"].items():
        layers.plot(range(len(row)), row, marker="o", label=mode)
    layers.axhline(0, color="black", linewidth=0.8)
    layers.set_xlabel("layer intervened on (alone)")
    layers.set_title("one layer at a time", fontsize=9)
    layers.legend(fontsize=7)
    return save_figure(fig, out / "interventions.png")


def _sweep_figure(sweep: dict[str, Any], base: float, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    points = sweep["points"]
    ax.plot([p["beta"] for p in points], [p["nll"] for p in points], marker="o")
    ax.axhline(base, color="black", linestyle="--", linewidth=0.8, label="default (β = 1)")
    ax.set_xlabel("β (orthogonal part scaled, every layer)")
    ax.set_ylabel("NLL (nats/token)")
    ax.set_title(f"best β = {sweep['best_beta']:g}", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "beta_sweep.png")


def _slots_figure(slots: dict[str, Any], heads: dict[str, Any], out: Path) -> Path:
    fig, (life, ess, inertia) = plt.subplots(1, 3, figsize=(13, 3.4), layout="constrained")
    _bars(life, slots["half_life_histogram"], "#4c72b0")
    life.set_yscale("log")
    life.set_xlabel("slot write half-life (tokens)")
    life.set_ylabel("slots")
    ess.plot(range(len(slots["ess_per_layer"])), slots["ess_per_layer"], marker="o")
    ess.set_xlabel("layer")
    ess.set_ylabel(f"slot-usage ESS (of {slots['num_slots']})")
    for layer, (x, y) in enumerate(zip(heads["routing_inertia"], heads["refinement_strength"],
                                       strict=True)):
        inertia.scatter(x, y, label=f"layer {layer}", s=18)
    inertia.set_xlabel("routing inertia")
    inertia.set_ylabel("refinement strength ||gΔ||/||o||")
    inertia.set_title(f"Pearson {heads['pearson']:.2f}, Spearman {heads['spearman']:.2f}",
                      fontsize=9)
    inertia.legend(fontsize=6)
    return save_figure(fig, out / "slots.png")


def render_asm_refinement(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and four PNGs into ``out``; return their paths."""
    results, model = record["results"], record["model"]
    geometry, interventions = results["geometry"], results["interventions"]
    nll, per_layer = interventions["nll"], interventions["per_layer_delta"]
    plots = [_geometry_figure(geometry, out), _intervention_figure(interventions, out),
             _sweep_figure(results["beta_sweep"], nll["default"], out),
             _slots_figure(results["slots"], results["heads"], out)]
    layers = len(geometry["alpha"]["median_per_layer"])
    geometry_rows = "\n".join(
        f"| {name} | {entry['median']:.3f} | {entry['quantiles']['p25']:.3f} | "
        f"{entry['quantiles']['p75']:.3f} | "
        + ", ".join(f"{v:.2f}" for v in entry["median_per_layer"]) + " |"
        for name, entry in geometry.items())
    intervention_rows = "\n".join(f"| {mode} | {value:.4f} | {interventions['delta'][mode]:+.4f} |"
                                  for mode, value in nll.items())
    layer_rows = "\n".join(
        f"| {layer} | {per_layer['parallel_only'][layer]:+.4f} | "
        f"{per_layer['orthogonal_only'][layer]:+.4f} | "
        f"{results['slots']['ess_per_layer'][layer]:.2f} | "
        f"{results['slots']['half_life_median_per_layer'][layer]:g} |" for layer in range(layers))
    sweep_rows = "\n".join(f"| {p['beta']:g} | {p['nll']:.4f} | {p['nll'] - nll['default']:+.4f} |"
                           for p in results["beta_sweep"]["points"])
    claims = "\n".join(f"| {name.replace('_', ' ')} | {'yes' if held else 'no'} |"
                       for name, held in results["claims"].items())
    report = out / "report.md"
    report.write_text(
        f"# asm-refinement\n\nModel `{model['name_or_path']}` ({model['num_parameters']:,} "
        f"parameters, weights {model['weights_digest']}) on {results['blocks']} blocks of "
        f"{results['context']} tokens ({results['tokens']:,} scored) from {results['corpus']}; "
        f"{record['wall_time_s']:.1f} s on {record['environment'].get('device', '?')}.\n\n"
        "## The paper's claims, as measured\n\n| claim | holds |\n| --- | --- |\n"
        f"{claims}\n\n## Geometry (figure 1)\n\n| statistic | median | p25 | p75 | median per "
        f"layer |\n| --- | --- | --- | --- | --- |\n{geometry_rows}\n\n![geometry](geometry.png)"
        "\n\n## Interventions (figures 2-3)\n\n| condition (every layer) | NLL | ΔNLL |\n"
        f"| --- | --- | --- |\n{intervention_rows}\n\n| layer | ΔNLL parallel-only | "
        "ΔNLL orthogonal-only | slot ESS | median write half-life |\n"
        f"| --- | --- | --- | --- | --- |\n{layer_rows}\n\n![interventions](interventions.png)\n\n"
        f"## β sweep (figure 4)\n\n| β | NLL | vs default |\n| --- | --- | --- |\n{sweep_rows}\n\n"
        f"![beta sweep](beta_sweep.png)\n\n## Slots and heads (section 5)\n\n"
        f"Routing inertia vs refinement strength over {layers} x "
        f"{len(results['heads']['routing_inertia'][0])} heads: Pearson "
        f"{results['heads']['pearson']:.3f}, Spearman {results['heads']['spearman']:.3f}.\n\n"
        "![slots](slots.png)\n")
    return [report, *plots]
