"""Figures for the ArithTransformer (paper: Assign and Add), drawn from ``arith-train`` logs.

- :func:`plot_accuracy` — accuracy by evaluation pool over training (the paper's figure 2);
- :func:`plot_progress` — progress measures over training (figure 12), phases marked;
- :func:`plot_fourier_neuron` — a layer-2 MLP neuron's pre-activation vs its Fourier fit
  (figure 11);
- :func:`plot_sweeps` — final accuracy against ``f`` and ``r`` over several runs (figure 3);
- :func:`write_report` — all of the above from log files, as PNGs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .figures import save_figure  # noqa: E402

__all__ = [
    "load_log",
    "plot_accuracy",
    "plot_fourier_neuron",
    "plot_progress",
    "plot_sweeps",
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


def plot_sweeps(logs: list[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Final accuracy against the training-pair fraction ``f = 1 - held_out_fraction`` (0-var
    held-out pairs) and against the 2-var ratio ``r`` (mean of the 2-var pools), figure 3.
    Returns None unless at least two runs differ in ``f`` or in ``r``; runs without held-out
    pairs (``f = 1``) have no point on the ``f`` panel."""
    def final(log):
        return log.get("final", {}).get("accuracy") or log["history"][-1]["accuracy"]

    by_f = sorted({(1 - lg["task"]["held_out_fraction"], final(lg)["0var/add_restricted"])
                   for lg in logs if "0var/add_restricted" in final(lg)})
    by_r = sorted({(lg["task"]["two_var_ratio"],
                    sum(v for k, v in final(lg).items() if k.startswith("2var/"))
                    / sum(k.startswith("2var/") for k in final(lg)))
                   for lg in logs})
    if len({x for x, _ in by_f}) < 2 and len({x for x, _ in by_r}) < 2:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, points, xlabel, ylabel, title in (
        (axes[0], by_r, "2-var : 0-var ratio r", "2-var accuracy", "(a) two-variable priming"),
        (axes[1], by_f, "fraction of pairs trained on, f", "0-var held-out-pair accuracy",
         "(b) training-set pairs"),
    ):
        ax.plot([x for x, _ in points], [y for _, y in points], "o-")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title, ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def write_report(logs: list[str | os.PathLike], out: str | os.PathLike) -> list[Path]:
    """Draw figures 2 and 12 for the first log, figure 11 from its ``final`` checkpoint (when
    present) and figure 3 across all logs (when they sweep ``f`` or ``r``). Returns the PNGs."""
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
    sweep = plot_sweeps(loaded, out / "arith_sweeps.png")
    if sweep is not None:
        paths.append(sweep)
    return paths
