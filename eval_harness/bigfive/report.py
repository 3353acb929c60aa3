"""The Big Five self-evaluation's report: DAS tables and bar plots per kind of answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["render_bigfive"]

METHOD_ORDER = ("prompt", "caa", "memory")
TRAIT_NAMES = {"O": "Openness", "C": "Conscientiousness", "E": "Extraversion",
               "A": "Agreeableness", "N": "Neuroticism"}


def _bigfive_tables(results: dict[str, Any], kind: str) -> tuple[str, dict]:
    runs = results["runs"]
    plain = next(r for r in runs if r["method"] == "plain")["scores"][kind]
    lines = [f"### DAS table ({kind} answers)", "",
             "| trait | method | score | shift | drift | DAS |",
             "| --- | --- | --- | --- | --- | --- |"]
    das: dict[str, dict[str, float]] = {}
    for trait in TRAIT_NAMES:
        chosen = [r for r in runs if r["target"] == trait]
        if not chosen:
            continue
        lines.append(f"| {TRAIT_NAMES[trait]} | plain | {plain[trait]:.2f} | 0.00 | 0.000 | "
                     "0.000 |")
        for run in sorted(chosen, key=lambda r: METHOD_ORDER.index(r["method"])):
            d = run["das"][kind]
            das.setdefault(run["method"], {})[trait] = d["das"]
            lines.append(f"| | {run['method']} | {run['scores'][kind][trait]:.2f} | "
                         f"{d['delta_target']:+.2f} | {d['drift']:.3f} | {d['das']:.3f} |")
    for method, row in results["summary"].items():
        m = row[kind]
        lines.append(f"| **average** | {method} | | {m['delta_target']:+.2f} | "
                     f"{m['drift']:.3f} | **{m['das']:.3f}** |")
    return "\n".join(lines), das


def _repetition_table(runs: list[dict[str, Any]]) -> str:
    """Per run: the judge's coherence beside the responses' repetition (mean per response)."""
    lines = ["### Repetition of the responses", "",
             "Mean per response: distinct-2 = distinct word bigrams / bigrams; repeated "
             "4-grams = share of its word 4-grams already seen earlier in it.", "",
             "| method | target | coherence 1-5 | distinct-2 | repeated 4-grams |",
             "| --- | --- | --- | --- | --- |"]
    for r in runs:
        q = r["repetition"]
        lines.append(f"| {r['method']} | {r['target'] or '—'} | {r['coherence']:.2f} | "
                     f"{q['distinct_2']:.2f} | {q['repeated_4gram']:.2f} |")
    return "\n".join(lines)


def _bar_plot(das: dict[str, dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHOD_ORDER if m in das]
    traits = [t for t in TRAIT_NAMES if any(t in das[m] for m in methods)]
    groups = traits + ["avg"]
    fig, ax = plt.subplots(figsize=(1.6 * len(groups) + 2, 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [das[method].get(t, 0.0) for t in traits]
        values.append(sum(values) / len(values))
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=method)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks([g + width * (len(methods) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([TRAIT_NAMES.get(g, "average") for g in groups], rotation=15)
    ax.set_ylabel("Δ target − non-target drift (DAS / GAS)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_bigfive(record: dict[str, Any], out: Path) -> list[Path]:
    """``report.md`` (the DAS tables, the judge, the repetition) and one DAS bar plot per kind
    of answer for a ``bigfive`` / ``bigfive-gen`` results record."""
    task = record["task"]
    results = record["results"]
    sections, paths = [], []
    kinds = ("greedy", "expected") if task == "bigfive" else ("judge",)
    title = "Big Five self-evaluation" if task == "bigfive" else "Big Five generation"
    for kind in kinds:
        table, das = _bigfive_tables(results, kind)
        plot = out / f"bigfive_das_{kind}.png"
        _bar_plot(das, plot, f"{title}, {kind} scores ({record['model']['name_or_path']})")
        sections.append(f"{table}\n\n![DAS]({plot.name})")
        paths.append(plot)
    if task == "bigfive-gen":
        judge = results["judge"]
        coherence = ", ".join(f"{r['method']}{'/' + r['target'] if r['target'] else ''} "
                              f"{r['coherence']:.2f}" for r in results["runs"])
        pairs = ("" if "pairs" not in judge else
                 "; agreement on the 80 labelled trait pairs: " + ", ".join(
                     f"{j['judge']} {j['overall']:.2f} ("
                     + " ".join(f"{t} {a:.2f}" for t, a in j["agreement"].items()) + ")"
                     for j in results.get("judges_compared", [judge["pairs"]])))
        sections.append(f"Judge `{judge['name']}` (validation accuracy "
                        f"{judge['validation']['accuracy']:.2f}{pairs}); coherence 1-5: "
                        f"{coherence}")
        if all("repetition" in r for r in results["runs"]):
            sections.append(_repetition_table(results["runs"]))
    header = (f"# {title}\n\nModel `{record['model']['name_or_path']}`, "
              f"{results['items']['count']} items, wall time {record['wall_time_s']:.0f} s, "
              f"git {record['environment']['git_sha']}.\n\nSelected sites per trait: "
              + "; ".join(f"{t}: layers {s['layers']}" for t, s in
                          results["calibration"]["selectors"].items()) + "\n")
    report = out / "report.md"
    report.write_text(header + "\n" + "\n\n".join(sections) + "\n")
    return [report, *paths]
