"""The report of a ``guidance`` results file: compliance per rule and method, likelihood and
generation (with the replies' repetition), the rule judge's agreement and a bar plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..figures import plt, save_figure

__all__ = ["render_guidance"]

_COLORS = {"plain": "#8c8c8c", "prompt": "#dd8452", "memory": "#4c72b0"}


def _ci(row: dict[str, Any], key: str, sign: str = "") -> str:
    if key not in row:  # a rule file's rule whose judge was refused: nothing judged
        return "not judged"
    low, high = row[f"{key}_ci"]
    return f"{row[key]:{sign}.2f} [{low:{sign}.2f}, {high:{sign}.2f}]"


def _repetition(row: dict[str, Any]) -> str:
    """The distinct-2 and repeated-4-gram cells ("—" in results recorded before they were)."""
    q = row.get("repetition")
    return "— | —" if q is None else f"{q['distinct_2']:.2f} | {q['repeated_4gram']:.2f}"


def _setup(rule: str, setup: dict[str, Any]) -> str:
    """A rule's memory: recipe (the persona call's), layers and KV against the visible rule."""
    memory, kv = setup["memory"], setup.get("kv")  # no kv in results recorded before it was
    recipe = f"{memory['recipe']} " if "recipe" in memory else ""
    return (f"{rule}: {recipe}at layers {memory['layers']}"
            + ("" if kv is None else f", {kv['memory_fraction']:.2f}x the rule's KV as a "
                                     f"prompt ({kv['memory_bytes']} / {kv['prompt_bytes']} "
                                     "bytes)"))


def render_guidance(record: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``guidance.png`` into ``out``; return their paths."""
    results = record["results"]
    rows, rules = results["rows"], results["config"]["rules"]
    methods = results["config"]["methods"]
    kinds = ["likelihood_compliance"] + (["generation_compliance"]
                                         if results["config"]["generate"] else [])
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.2 * len(kinds), 3.4), squeeze=False,
                             layout="constrained")
    width = 0.8 / len(methods)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for k, method in enumerate(methods):
            mine = [next(r for r in rows if r["rule"] == rule and r["method"] == method)
                    for rule in rules]
            xs = np.arange(len(rules)) + (k - (len(methods) - 1) / 2) * width
            values = [r.get(kind, np.nan) for r in mine]  # nan: not judged
            errors = [[v - r.get(f"{kind}_ci", (v, v))[0] for v, r in zip(values, mine,
                                                                          strict=True)],
                      [r.get(f"{kind}_ci", (v, v))[1] - v for v, r in zip(values, mine,
                                                                          strict=True)]]
            ax.bar(xs, values, width, yerr=errors, label=method, color=_COLORS.get(method),
                   capsize=2)
        ax.set_xticks(range(len(rules)), rules)
        ax.set_ylim(0, 1.05)
        ax.set_title(kind.replace("_", " "), fontsize=9)
    axes[0][0].set_ylabel("share of held-out questions")
    axes[0][0].legend(fontsize=7)
    plot = save_figure(fig, out / "guidance.png")
    generated = len(kinds) > 1
    header = ("| rule | method | likelihood compliance [95 % CI] | margin shift over plain "
              "[95 % CI] |" + (" generation compliance [95 % CI] | distinct-2 | repeated "
                               "4-grams |" if generated else "")
              + "\n| --- | --- | --- | --- |" + (" --- | --- | --- |" if generated else ""))
    lines = [f"| {r['rule']} | {r['method']} | {_ci(r, 'likelihood_compliance')} | "
             f"{_ci(r, 'shift', '+')} |"
             + (f" {_ci(r, 'generation_compliance')} | {_repetition(r)} |" if generated else "")
             for r in rows]
    judge = results["judge"]
    agreement = ("" if judge is None else
                 f"Rule judge `{judge['judge']}`, agreement with the labelled replies"
                 + (" (fitted per rule, held out over folds)" if results["config"].get(
                     "rule_file") else "") + ": "
                 + ", ".join(f"{rule} refused ({v['refused']})" if "refused" in v
                             else f"{rule} {v['agreement']:.2f} ({v['labelled']})"
                             for rule, v in judge["rules"].items()) + ". Repetition of the "
                 "replies, mean per reply: distinct-2 = distinct word bigrams / bigrams, "
                 "repeated 4-grams = share of its word 4-grams already seen earlier in it.\n\n")
    sites = "; ".join(_setup(rule, s) for rule, s in results["setups"].items())
    report = out / "report.md"
    report.write_text(
        f"# guidance\n\nModel `{record['model'].get('name_or_path', '?')}`; "
        f"{record['wall_time_s']:.0f} s on {record['environment'].get('device', '?')}. A rule "
        "as a visible system prompt vs as memory at its frozen sites ("
        + ("the one-line persona call's" if results["config"].get("persona_recipes")
           else "a behavioural selector's") + f"; {sites}).\n\n{agreement}" + header + "\n"
        + "\n".join(lines)
        + f"\n\n![compliance]({plot.name})\n")
    return [report, plot]
