"""Tables (Markdown) and plots (PNG) from a results JSON, for a person to look at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .names import FAMILY_TASKS

__all__ = ["render_report"]

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


def _kv_report(results: dict[str, Any], out: Path, record: dict[str, Any]) -> list[Path]:
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


def _ffn_report(record: dict[str, Any], out: Path) -> list[Path]:
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


def render_report(results_path: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write ``report.md`` and PNG plots next to (or into ``out`` for) a results JSON."""
    path = Path(results_path)
    if path.is_dir():
        path = path / "results.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read results from {path}: {error}") from None
    out = Path(out) if out is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    task = record.get("task")
    if task == "trait-steering":
        from .trait_report import render_trait_steering

        return render_trait_steering(record, out)
    if task == "layer-ablation":
        from .trait_report import render_layer_ablation

        return render_layer_ablation(record, out)
    if task == "kv-footprint":
        return _kv_report(record["results"], out, record)
    if task == "ffn-memories":
        return _ffn_report(record, out)
    if task == "persistence":
        from .persistence_report import render_persistence

        return render_persistence(record, out)
    if task == "guidance":
        from .guidance_report import render_guidance

        return render_guidance(record, out)
    if task == "dialogue-shift":
        from .dialogue_shift_report import render_dialogue_shift

        return render_dialogue_shift(record, out)
    if task == "tradeoff":
        from .tradeoff_report import render_tradeoff

        return render_tradeoff(record, out)
    if task == "capability":
        from .capability_report import render_capability

        return render_capability(record, out)
    if task == "asm-refinement":
        from .asm_refinement_report import render_asm_refinement

        return render_asm_refinement(record, out)
    if task in FAMILY_TASKS:
        from .family_report import render_family_report

        return render_family_report(record, out)
    if task not in ("bigfive", "bigfive-gen"):
        raise ValueError(f"{path} holds results of an unknown task {task!r}")
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
