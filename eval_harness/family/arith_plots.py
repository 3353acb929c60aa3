"""Figures for the ArithTransformer (paper: Assign and Add), drawn from ``arith-train`` logs.

- :func:`plot_accuracy` — accuracy by evaluation pool over training (the paper's figure 2);
- :func:`plot_progress` — progress measures over training (figure 12), phases marked;
- :func:`plot_fourier_neuron` — a layer-2 MLP neuron's pre-activation vs its Fourier fit
  (figure 11);
- :func:`plot_sweeps` — final accuracy against ``f`` and ``r`` over several runs (figure 3),
  from :func:`sweep_points`, tabulated by :func:`sweep_table`, and over training by
  :func:`plot_sweep_curves`;
- :func:`write_report` — all of the above from log files, as PNGs (and the sweep table).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..figures import save_figure  # noqa: E402

__all__ = [
    "load_log",
    "plot_accuracy",
    "plot_fourier_neuron",
    "plot_progress",
    "plot_sweep_curves",
    "plot_sweeps",
    "sweep_points",
    "sweep_table",
    "training_phases",
    "write_report",
]

_RATIO_MEASURES = ("fourier_num_frequencies",)


def load_log(path: str | os.PathLike) -> dict[str, Any]:
    """Read an ``arith-train`` log (the ``log.json`` file or its directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "log.json"
    log = json.loads(path.read_text())
    if "history" not in log:
        raise ValueError(f"{path} is not an arith-train log (no 'history')")
    log["_path"] = str(path)
    return log


def training_phases(history: list[dict[str, Any]]) -> dict[str, int | None]:
    """The three phases, each dated by the evaluation step that ends its steepest rise, each
    searched after the previous phase's step:

    1. ``addition``: of ``0var/train``;
    2. ``binding``: of the mean of ``1var/train`` and ``2var/train``;
    3. ``refinement``: of the mean of the var-restricted pools.

    Threshold-free, so sampling noise of the evaluation pools does not move the marks. ``None``
    where the pools are missing or never rise.
    """
    groups = {
        "addition": ["0var/train"],
        "binding": ["1var/train", "2var/train"],
        "refinement": [k for k in history[0]["accuracy"] if "var_restricted" in k],
    }
    phases: dict[str, int | None] = {}
    after = -1
    for phase, names in groups.items():
        if not names or any(n not in history[0]["accuracy"] for n in names):
            phases[phase] = None
            continue
        curve = [sum(h["accuracy"][n] for n in names) / len(names) for h in history]
        rises = [(curve[i] - curve[i - 1], history[i]["step"]) for i in range(1, len(curve))
                 if history[i - 1]["step"] >= after]
        best = max(rises, default=(0.0, None))
        phases[phase] = best[1] if best[0] > 0 else None
        after = best[1] if best[0] > 0 else after
    return phases


def _mark_phases(ax, history: list[dict[str, Any]]) -> None:
    for (name, step), color in zip(training_phases(history).items(), ("C0", "C1", "C2"),
                                   strict=True):
        if step is not None:
            ax.axvline(step, color=color, ls=":", lw=1)
            ax.text(step, 1.01, f"{name}\n@{step}", color=color, fontsize=7, ha="center",
                    va="bottom", transform=ax.get_xaxis_transform())


def plot_accuracy(log: dict[str, Any], path: str | os.PathLike) -> Path:
    """Accuracy by pool over training (figure 2)."""
    history = log["history"]
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, name in enumerate(history[0]["accuracy"]):
        curated = "/" not in name
        ax.plot(steps, [h["accuracy"][name] for h in history], label=name,
                ls="--" if curated else "-", lw=1.2, color=f"C{i % 10}" if i < 10 else "k")
    _mark_phases(ax, history)
    ax.set(xlabel="training step", ylabel="accuracy", ylim=(-0.02, 1.02))
    ax.set_title("Accuracy by evaluation pool", pad=24)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_progress(log: dict[str, Any], path: str | os.PathLike) -> Path:
    """Progress measures over training (figure 12); phase ends as dotted lines."""
    history = log["history"]
    steps = [h["step"] for h in history]
    names = [k for k in history[0]["progress"] if k not in _RATIO_MEASURES]
    fig, ax = plt.subplots(figsize=(9, 5))
    for name in names:
        ax.plot(steps, [h["progress"][name] for h in history], label=name, lw=1.2)
    _mark_phases(ax, history)
    ax.set(xlabel="training step", ylabel="measure", ylim=(-0.02, 1.02))
    ax.set_title("Progress measures (appendix B)", pad=24)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_fourier_neuron(model, path: str | os.PathLike, neuron: int | None = None) -> Path:
    """Pre-activation of one last-layer MLP neuron on ``OV(e_a) + OV(e_b)`` over all pairs, next
    to its best single-frequency fit (figure 11). Default neuron: the largest-variance one among
    those whose fit explains >= 90% of the variance (else the largest-variance one)."""
    import torch

    from modeling.arith import fourier_analysis, ov2_mlp2_logits

    with torch.no_grad():
        _, pre = ov2_mlp2_logits(model)
        fourier = fourier_analysis(pre)
    if neuron is None:
        variance = fourier["variance"].clone()
        good = fourier["explained_variance"] >= 0.9
        if good.any():
            variance[~good] = -1.0
        neuron = int(variance.argmax())
    raw, fit = pre[..., neuron].numpy(), fourier["fit"][..., neuron].numpy()
    k = int(fourier["best_frequency"][neuron])
    r2 = float(fourier["explained_variance"][neuron])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    lo, hi = min(raw.min(), fit.min()), max(raw.max(), fit.max())
    for ax, data, title in zip(axes, (raw, fit),
                               (f"neuron {neuron}: pre-activation",
                                f"Fourier fit, k = {k} (R² = {r2:.3f})"), strict=True):
        image = ax.imshow(data, origin="lower", cmap="RdBu_r", vmin=lo, vmax=hi)
        ax.set(xlabel="b (right operand)", ylabel="a (left operand)", title=title)
    fig.colorbar(image, ax=axes, shrink=0.8)
    return save_figure(fig, path)


def _final_accuracy(log: dict[str, Any]) -> dict[str, float]:
    return log.get("final", {}).get("accuracy") or log["history"][-1]["accuracy"]


def _steps(log: dict[str, Any]) -> int:
    return log.get("final", {}).get("step") or log["history"][-1]["step"]


def _mode(values: list[float]) -> float:
    return max(sorted(set(values)), key=values.count)


def _sweep_score(axis: str, value: float, accuracy: dict[str, float]) -> float:
    """The quantity figure 3 plots: for ``r`` the mean of the 2-var pools, for ``f`` the
    accuracy on all 0-var sequences (seen and held-out pairs weighted by their share)."""
    if axis == "r":
        two_var = [pool for pool in accuracy if pool.startswith("2var/")]
        return sum(accuracy[pool] for pool in two_var) / len(two_var)
    if "0var/add_restricted" in accuracy:
        return value * accuracy["0var/train"] + (1 - value) * accuracy["0var/add_restricted"]
    return accuracy["0var/train"]  # f = 1: every pair trained on


def _sweep_panels(logs: list[dict[str, Any]]) -> tuple[float, float, dict[str, list]]:
    """``(base_f, base_r, {"r": [(r, log)], "f": [(f, log)]})``: a run sits on the ``r`` panel
    when its ``f`` is the most common ``f``, on the ``f`` panel when its ``r`` is the most
    common ``r``."""
    fs = [round(1 - lg["task"]["held_out_fraction"], 6) for lg in logs]
    rs = [round(lg["task"]["two_var_ratio"], 6) for lg in logs]
    base_f, base_r = _mode(fs), _mode(rs)
    panels: dict[str, list] = {"r": [], "f": []}
    for log, f, r in zip(logs, fs, rs, strict=True):
        if f == base_f:
            panels["r"].append((r, log))
        if r == base_r:
            panels["f"].append((f, log))
    return base_f, base_r, panels


def sweep_points(logs: list[dict[str, Any]]) -> dict[str, Any]:
    """Figure 3's points from runs that sweep ``r`` (2-var : 0-var ratio) or ``f`` (fraction of
    addition pairs trained on, ``1 - held_out_fraction``).

    A run sits on the ``r`` panel when its ``f`` is the most common ``f`` of the runs, and on the
    ``f`` panel when its ``r`` is the most common ``r`` (the base run sits on both). Runs of one
    setting (seeds) are averaged. Per point: ``value``, ``runs``, the mean ``accuracy`` by pool
    and ``score``: for ``r`` the mean of the 2-var pools, for ``f`` the accuracy on all 0-var
    sequences, ``f · acc(0var/train) + (1 - f) · acc(0var/add_restricted)`` (pairs are drawn
    uniformly; the held-out pool alone is ``accuracy['0var/add_restricted']``). Raises
    ValueError when the runs trained for different numbers of steps (not comparable).
    """
    steps = sorted({_steps(lg) for lg in logs})
    if len(steps) > 1:
        raise ValueError(f"the sweep's runs trained for different numbers of steps {steps}; "
                         "pass runs of one length")
    base_f, base_r, panels = _sweep_panels(logs)

    def points(axis: str) -> list[dict[str, Any]]:
        groups: dict[float, list[dict[str, float]]] = {}
        for value, log in panels[axis]:
            groups.setdefault(value, []).append(_final_accuracy(log))
        result = []
        for value, runs in sorted(groups.items()):
            pools = sorted(set.intersection(*(set(run) for run in runs)))
            accuracy = {pool: sum(run[pool] for run in runs) / len(runs) for pool in pools}
            result.append({"value": value, "runs": len(runs),
                           "score": _sweep_score(axis, value, accuracy), "accuracy": accuracy})
        return result

    return {"steps": steps[0] if steps else None, "base_f": base_f, "base_r": base_r,
            "r": points("r"), "f": points("f")}


def plot_sweep_curves(logs: list[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Figure 3's quantities over training, one curve per run: whether a setting below a
    threshold learns later or never. Returns None unless the runs differ in ``f`` or ``r``."""
    _, _, panels = _sweep_panels(logs)
    if all(len({value for value, _ in panels[axis]}) < 2 for axis in panels):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    titles = {"r": "(a) 2-var accuracy (mean of pools), by r",
              "f": "(b) 0-var accuracy (all pairs), by f"}
    for ax, axis in zip(axes, ("r", "f"), strict=True):
        values = sorted({value for value, _ in panels[axis]})
        colors = plt.cm.viridis([i / max(len(values) - 1, 1) for i in range(len(values))])
        labelled = set()
        for value, log in sorted(panels[axis], key=lambda item: item[0]):
            history = log["history"]
            color = colors[values.index(value)]
            ax.plot([h["step"] for h in history],
                    [_sweep_score(axis, value, h["accuracy"]) for h in history], color=color,
                    lw=1.3, label=None if value in labelled else f"{axis} = {value:.3g}")
            labelled.add(value)
        ax.set(xlabel="training step", title=titles[axis], ylim=(-0.02, 1.02))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (evaluation pools)")
    return save_figure(fig, path)


def sweep_table(points: dict[str, Any]) -> str:
    """The figure-3 points as two markdown tables (percent)."""
    lines = []
    for axis, score, pools in (
        ("r", "2-var (mean of pools)", ("2var/train", "2var/add_restricted",
                                        "2var/var_restricted(1)", "2var/var_restricted(2)")),
        ("f", "0-var (all pairs)", ("0var/train", "0var/add_restricted")),
    ):
        if len(points[axis]) < 2:
            continue
        lines += [f"| {axis} | runs | {score} | " + " | ".join(pools) + " |",
                  "| --- " * (len(pools) + 3) + "|"]
        for point in points[axis]:
            cells = [f"{100 * point['accuracy'][p]:.1f}" if p in point["accuracy"] else "—"
                     for p in pools]
            lines.append(f"| {point['value']:.3g} | {point['runs']} | "
                         f"{100 * point['score']:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_sweeps(logs: list[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Figure 3 from :func:`sweep_points`: (a) 2-var accuracy against ``r``, (b) 0-var accuracy
    against ``f`` (all pairs, and the held-out pairs alone). Returns None unless at least two
    runs differ in ``f`` or in ``r``."""
    return _draw_sweeps(sweep_points(logs), path)


def _draw_sweeps(points: dict[str, Any], path: str | os.PathLike) -> Path | None:
    if len(points["r"]) < 2 and len(points["f"]) < 2:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (
        (axes[0], points["r"], "2-var : 0-var ratio r", "2-var accuracy",
         "(a) two-variable priming",
         {"mean of 2-var pools": None, "2-var train pool": "2var/train"}),
        (axes[1], points["f"], "fraction of pairs trained on, f", "0-var accuracy",
         "(b) training-set pairs", {"all 0-var pairs": None,
                                    "held-out pairs only": "0var/add_restricted"}),
    )
    for ax, series, xlabel, ylabel, title, curves in panels:
        for (label, pool), style in zip(curves.items(), ("o-", "s--"), strict=True):
            xs = [p["value"] for p in series if pool is None or pool in p["accuracy"]]
            ys = [p["score"] if pool is None else p["accuracy"][pool] for p in series
                  if pool is None or pool in p["accuracy"]]
            ax.plot(xs, ys, style, label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title, ylim=(-0.02, 1.02))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if points["steps"] is not None:
        fig.suptitle(f"after {points['steps']:,} training steps", fontsize=9)
    return save_figure(fig, path)


def write_report(logs: list[str | os.PathLike], out: str | os.PathLike) -> list[Path]:
    """Draw figures 2 and 12 for the first log, figure 11 from its ``final`` checkpoint (when
    present) and figure 3 with its table (``arith_sweeps.md``) and its curves over training
    across all logs (when they sweep ``f`` or ``r``). Returns the files written."""
    loaded = [load_log(p) for p in logs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    first = loaded[0]
    paths = [plot_accuracy(first, out / "arith_accuracy.png"),
             plot_progress(first, out / "arith_progress.png")]
    final_dir = Path(first["_path"]).parent / "final"
    if (final_dir / "config.json").is_file():
        from modeling.arith import ArithTransformer

        model = ArithTransformer.from_pretrained(final_dir)
        paths.append(plot_fourier_neuron(model, out / "arith_fourier_neuron.png"))
    points = sweep_points(loaded)
    sweep = _draw_sweeps(points, out / "arith_sweeps.png")
    if sweep is not None:
        paths += [sweep, plot_sweep_curves(loaded, out / "arith_sweep_curves.png")]
        table = out / "arith_sweeps.md"
        table.write_text(sweep_table(points))
        paths.append(table)
    return paths
