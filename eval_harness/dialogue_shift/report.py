"""The report of a ``dialogue-shift`` results file: post-shift Align per transition and method
with intervals, by length, the guidance each method carries, and a per-turn plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..figures import plt, save_figure

__all__ = ["render_dialogue_shift"]

_COLORS = {"plain": "#8c8c8c", "prompt-init": "#dd8452", "caa": "#55a868", "memory": "#4c72b0",
           "prompt-repl": "#c44e52"}


def _table(rows: list[dict[str, Any]], key: str, label: str) -> str:
    lines = [f"| {label} | method | cases | post-shift Align [95 % CI] | shift over plain "
             "[95 % CI] | pre-shift Align | switch over plain's [95 % CI] |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r[key]} | {r['method']} | {r['cases']} | {r['align']:+.2f} "
                     f"[{r['align_ci'][0]:+.2f}, {r['align_ci'][1]:+.2f}] | {r['shift']:+.2f} "
                     f"[{r['shift_ci'][0]:+.2f}, {r['shift_ci'][1]:+.2f}] | "
                     f"{r['pre_align']:+.2f} | {r['switch']:+.2f} "
                     f"[{r['switch_ci'][0]:+.2f}, {r['switch_ci'][1]:+.2f}] |")
    return "\n".join(lines)


def _per_turn_plot(results: dict[str, Any], out: Path) -> Path:
    """Mean Align over plain's at the same turn, against the turn relative to the shift, per
    method (every case; the content of each turn cancels)."""
    methods = [m for m in results["config"]["methods"] if m != "plain"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    for method in methods:
        by_offset: dict[int, list[float]] = {}
        for case in results["cases"]:
            plain = case["methods"]["plain"]["align"]
            for turn, value in enumerate(case["methods"][method]["align"], start=1):
                by_offset.setdefault(turn - case["shift_turn"], []).append(
                    value - plain[turn - 1])
        xs = sorted(by_offset)
        ax.plot(xs, [np.mean(by_offset[x]) for x in xs], marker=".", label=method,
                color=_COLORS.get(method))
    ax.axvline(-0.5, color="black", linewidth=0.8, linestyle=":")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("turn relative to the shift request")
    ax.set_ylabel("Align − plain's Align (nats)")
    ax.legend(fontsize=7)
    return save_figure(fig, out / "dialogue_shift.png")


def render_dialogue_shift(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``dialogue_shift.png`` into ``out``; return their paths."""
    results = record["results"]
    plot = _per_turn_plot(results, out)
    methods = results["config"]["methods"]
    computed = {m: np.mean([c["methods"][m]["computed_tokens"] for c in results["cases"]])
                for m in methods}
    kv_rows = []
    for transition, entry in results["kv"].items():
        for method in methods:
            kv_rows.append(f"| {transition} | {method} | {entry[method]['visible']:,} | "
                           f"{entry[method]['latent']:,} |")
    claims = results["claims"]
    setups = "; ".join(f"{t}: memory {_memory_setup(s['memory'])}, CAA scale "
                       f"{s['caa']['scale']:g}" for t, s in results["setups"].items())
    report = out / "report.md"
    report.write_text(
        f"# dialogue-shift\n\nModel `{record['model'].get('name_or_path', '?')}`; "
        f"{record['wall_time_s']:.0f} s on {record['environment'].get('device', '?')}; "
        f"{len(results['cases'])} cases; post-shift transcript in the "
        f"{results['config']['post_shift_history']} style. Align = log p(new-style reply) − "
        "log p(old-style reply) of the held-out continuations, mean over post-shift turns per "
        "case; intervals: bootstrap over cases. The switch is how much more Align rose from "
        "before to after the shift than plain's did (what the guidance's change did, net of "
        "what the guidance does whatever its content). `prompt-repl` is the audit condition "
        "(it rewrites the visible system prompt at the shift).\n\n"
        f"Best fixed-budget method overall: **{claims['best_matched_method_overall']}**; memory "
        f"best on {len(claims['memory_best_transitions'])} of {len(claims['best_by_transition'])}"
        f" transitions.\n\nFrozen guidance: {setups}.\n\n## By transition\n\n"
        + _table(results["by_transition"], "transition", "transition")
        + "\n\n## By length\n\n" + _table(results["by_length"], "turns", "turns")
        + "\n\n## Overall\n\n" + _table(results["overall"], "group", "cases")
        + "\n\n## Guidance carried\n\nBytes per conversation: visible = the prompt's tokens in "
        "the KV cache; latent = bank tensors at the steered layers, or the CAA vector. Tokens "
        "run through the model per case (mean): "
        + ", ".join(f"{m} {computed[m]:,.0f}" for m in methods)
        + ".\n\n| transition | method | visible KV bytes | latent bytes |\n| --- | --- | --- | "
        "--- |\n" + "\n".join(kv_rows) + f"\n\n![per-turn Align]({plot.name})\n"
        + _generation_section(results))
    return [report, plot]


def _memory_setup(memory: dict[str, Any]) -> str:
    """The memory's sites: one selector's layers, or each style's persona call (recipe,
    layers, strength)."""
    if "layers" in memory:
        return f"layers {memory['layers']}"
    return ", ".join(f"{key} {m['recipe']} at layers {m['layers']} (strength "
                     f"{m['strength']:g})" for key, m in memory.items())


def _repetition(row: dict[str, Any]) -> str:
    """The distinct-2 and repeated-4-gram cells ("—" in results recorded before they were)."""
    q = row.get("repetition")
    return "— | —" if q is None else f"{q['distinct_2']:.2f} | {q['repeated_4gram']:.2f}"


def _generation_section(results: dict[str, Any]) -> str:
    if "generation" not in results:
        return ""
    generation = results["generation"]
    judge = generation["judge"]
    rows = ["| transition | method | cases | post-shift judged Align [95 % CI] | shift over "
            "plain [95 % CI] | pre-shift | coherence 1-5 | distinct-2 | repeated 4-grams |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in generation["by_transition"] + generation["overall"]:
        rows.append(f"| {r.get('transition', 'all')} | {r['method']} | {r['cases']} | "
                    f"{r['align']:+.2f} [{r['align_ci'][0]:+.2f}, {r['align_ci'][1]:+.2f}] | "
                    f"{r['shift']:+.2f} [{r['shift_ci'][0]:+.2f}, {r['shift_ci'][1]:+.2f}] | "
                    f"{r['pre_align']:+.2f} | {r['coherence']:.2f} | {_repetition(r)} |")
    agreement = ", ".join(f"{k} {v['agreement']:.2f}" for k, v in judge["styles"].items())
    return ("\n## Generation form\n\nThe model writes every turn (greedy); each reply is "
            f"judged by `{judge['judge']}` (agreement with the labelled style pairs" + (
                ", held out over folds" if judge["judge"] == "reply-judge-per-pair" else "")
            + f": {agreement}; overall {judge['overall']:.2f}). Align = score(new style) − "
            "score(old style), each on " + ("0-1 (the judge's probability)"
                                            if judge["judge"] == "reply-judge-per-pair"
                                            else "1-5")
            + "; coherence = distinct-bigram share on 1-5, a crude "
            "quality proxy for the paper's Q_turn (post-shift turns). Repetition over every "
            "turn the model wrote, mean per reply: distinct-2 = distinct word bigrams / "
            "bigrams, repeated 4-grams = share of its word 4-grams already seen earlier in "
            "it.\n\n" + "\n".join(rows) + "\n")
