"""Report of the ``trait-steering`` and ``layer-ablation`` tasks: DAS tables with intervals,
controls, selected sites with their routing mass, and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import plt, save_figure

__all__ = ["render_layer_ablation", "render_trait_steering"]

METHODS = ("prompt", "caa", "memory", "memory-diagnostic")
CONTROLS = ("memory-neutral", "memory-reference", "prompt-neutral", "prompt-reference")


def _ci(result: dict[str, Any], name: str) -> str:
    value = f"{result[name]:+.2f}"
    if f"{name}_ci" in result:
        low, high = result[f"{name}_ci"]
        value += f" [{low:+.2f}, {high:+.2f}]"
    return value


def _summary_table(summary: dict[str, Any], task: str) -> list[str]:
    lines = ["| method | target shift | drift | DAS | right way | CI above 0 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for method in (*METHODS, *CONTROLS):
        entry = summary.get(method, {}).get(task)
        if entry:
            lines.append(f"| {method} | {entry['target_shift']:+.2f} | {entry['drift']:.2f} | "
                         f"**{entry['das']:+.2f}** | {entry['right_way']}/{entry['directions']}"
                         f" | {entry['significant']}/{entry['directions']} |")
    return lines


def _judged_table(setups: dict[str, Any], by: dict, directions: list[str]) -> list[str]:
    """Judged replies per direction: each method's judge score (the share of its replies on the
    direction's side) and perplexity; a refused judge says so."""
    judged = [d for d in directions if "judged" in setups[d]]
    if not judged:
        return []
    methods = ("plain", "prompt", "caa", "memory")
    lines = ["", "## Judged replies (what users see)", "",
             "Greedy replies to held-out questions of the direction's trait, scored by a reply "
             "judge fitted on the direction's calibration pairs: judge score (share of replies on "
             "the direction's side), perplexity under the plain model.", "",
             "| direction | judge acc. | " + " | ".join(methods) + " |",
             "|" + " --- |" * (len(methods) + 2)]
    for d in judged:
        entry = setups[d]["judged"]
        accuracy = f"{entry['judge']['held_out_accuracy']:.2f}"
        if "refused" in entry:
            lines.append(f"| {d} | {accuracy} (refused) |" + " |" * len(methods))
            continue
        rows = {"plain": entry["plain"], **{m: by[(d, m)]["judged"] for m in methods[1:]
                                             if "judged" in by.get((d, m), {})}}
        cells = [f"{rows[m]['judge_score']:.2f} ({rows[m]['target_share']:.0%}); "
                 f"ppl {rows[m]['perplexity']:.1f}" if m in rows else "" for m in methods]
        lines.append(f"| {d} | {accuracy} | " + " | ".join(cells) + " |")
    return lines


def render_trait_steering(record: dict[str, Any], out: Path) -> list[Path]:
    results = record["results"]
    runs, setups = results["runs"], results["setups"]
    directions = list(setups)
    by = {(r["direction"], r["method"]): r for r in runs}
    lines = [f"# Trait steering on `{record['model']['name_or_path']}`", "",
             f"{len(directions)} directions; {results['items']['likelihood']} held-out "
             f"likelihood pairs, {results['items']['questionnaire']} IPIP items; wall time "
             f"{record['wall_time_s']:.0f} s; git {record['environment']['git_sha']}.", "",
             "## Summary (mean over directions)", "", "### Likelihood task (nats)", "",
             *_summary_table(results["summary"], "likelihood"), "",
             "### Questionnaire, acquiescence-corrected (Likert points / 2)", "",
             *_summary_table(results["summary"], "questionnaire"), "",
             "## Per direction (likelihood: target shift [95 % CI], drift, DAS)", "",
             "| direction | " + " | ".join(METHODS) + " |", "|" + " --- |" * (len(METHODS) + 1)]
    for d in directions:
        cells = []
        for m in METHODS:
            run = by.get((d, m))
            cells.append("" if run is None else
                         f"{_ci(run['likelihood'], 'target_shift')}; "
                         f"{run['likelihood']['drift']:.2f}; {run['likelihood']['das']:+.2f}")
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    lines += ["", "## Per direction (questionnaire: target shift [95 % CI]; acquiescence)", "",
              "| direction | " + " | ".join(METHODS) + " |", "|" + " --- |" * (len(METHODS) + 1)]
    for d in directions:
        cells = []
        for m in METHODS:
            run = by.get((d, m))
            cells.append("" if run is None or "questionnaire" not in run else
                         f"{_ci(run['questionnaire'], 'target_shift')}; "
                         f"{run['questionnaire']['acquiescence']:+.2f}")
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    lines += _judged_table(setups, by, directions)
    if any((d, "memory-neutral") in by for d in directions):
        lines += ["", "## Controls (likelihood target shift)", "",
                  "Same sites and gains as the memory condition with a neutral bank and with the "
                  "reference (opposite) bank; the directional effect is target − reference. "
                  "The prompt's three are the guidance, a neutral text and the opposite "
                  "descriptor as the visible prompt.", "",
                  "| direction | memory | neutral bank | reference bank | memory T−R | prompt | "
                  "neutral prompt | reference prompt | prompt T−R |", "|" + " --- |" * 9]
        for d in directions:
            v = {m: by[(d, m)]["likelihood"]["target_shift"] for m in (*METHODS, *CONTROLS)
                 if (d, m) in by}
            lines.append(
                f"| {d} | {v['memory']:+.2f} | {v['memory-neutral']:+.2f} | "
                f"{v['memory-reference']:+.2f} | {v['memory'] - v['memory-reference']:+.2f} | "
                f"{v['prompt']:+.2f} | {v['prompt-neutral']:+.2f} | "
                f"{v['prompt-reference']:+.2f} | {v['prompt'] - v['prompt-reference']:+.2f} |")
    lines += ["", "## Frozen sites, gains and routing mass", "",
              "| direction | behavioural layers (ρ) | bank mass per layer | KV ratio | "
              "diagnostic layers | CAA scale |", "| --- | --- | --- | --- | --- | --- |"]
    for d in directions:
        s = setups[d]
        mem = s["memory"]
        gain = next(iter(mem["gain"].values()))
        mass = ", ".join(f"{layer}: {_bank_mass(m):.2f}"
                         for layer, m in mem["routing_mass"].items())
        diagnostic = s.get("memory-diagnostic", {}).get("layers", "")
        lines.append(f"| {d} | {mem['layers']} ({gain:g}) | {mass} | "
                     f"{s['kv']['actual_ratio']:.1f}x | {diagnostic} | {s['caa']['scale']:g} |")
    plot = _das_plot(by, directions, out / "trait_steering_das.png",
                     f"DAS per direction, likelihood task ({record['model']['name_or_path']})")
    lines += ["", f"![DAS per direction]({plot.name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return [report, plot]


def _bank_mass(per_source: dict[str, float]) -> float:
    """Routing mass on the banks at one layer: everything that is not the prompt."""
    return sum(mass for source, mass in per_source.items() if source != "prompt")


def _das_plot(by: dict, directions: list[str], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(1.1 * len(directions) + 2, 4))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        values = [by[(d, method)]["likelihood"]["das"] if (d, method) in by else 0.0
                  for d in directions]
        ax.bar([x + i * width for x in range(len(directions))], values, width, label=method)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(METHODS) - 1) / 2 for x in range(len(directions))])
    ax.set_xticklabels(directions)
    ax.set_ylabel("DAS (nats): target shift − drift")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def render_layer_ablation(record: dict[str, Any], out: Path) -> list[Path]:
    rows = record["results"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lines = [f"# Layer ablation on `{record['model']['name_or_path']}`", "",
             "Layers added in the order of the behavioural search's single-layer scores, at the "
             "gain it chose; effect on the held-out likelihood pairs.", "",
             "| direction | k | layers | target shift [95 % CI] | drift | bank KV bytes | "
             "prompt shift | prompt KV bytes |", "|" + " --- |" * 8]
    for row in rows:
        ks = [len(s["layers"]) for s in row["steps"]]
        axes[0].plot(ks, [s["target_shift"] for s in row["steps"]], marker="o",
                     label=f"memory {row['direction']}")
        axes[0].axhline(row["prompt"]["target_shift"], linestyle="--",
                        color=axes[0].lines[-1].get_color(), label=f"prompt {row['direction']}")
        axes[1].plot(ks, [s["bank_bytes"] for s in row["steps"]], marker="o",
                     label=f"bank {row['direction']}")
        axes[1].axhline(row["prompt_kv_bytes"], linestyle="--",
                        color=axes[1].lines[-1].get_color(), label=f"prompt {row['direction']}")
        for s in row["steps"]:
            lines.append(f"| {row['direction']} | {len(s['layers'])} | {s['layers']} | "
                         f"{_ci(s, 'target_shift')} | {s['drift']:.2f} | {s['bank_bytes']:,} | "
                         f"{row['prompt']['target_shift']:+.2f} | {row['prompt_kv_bytes']:,} |")
    axes[0].set_xlabel("steered layers k")
    axes[0].set_ylabel("target shift (nats)")
    axes[0].axhline(0, color="black", linewidth=0.6)
    axes[1].set_xlabel("steered layers k")
    axes[1].set_ylabel("KV bytes of the guidance")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle("Effect and KV footprint vs number of steered layers")
    plot = save_figure(fig, out / "layer_ablation.png")
    report = out / "report.md"
    report.write_text("\n".join(lines) + f"\n\n![layer ablation]({plot.name})\n")
    return [report, plot]
