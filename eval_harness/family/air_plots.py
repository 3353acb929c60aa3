"""Figures for the AIRSolver (paper: One Model, Two Roles), from ``air-train`` runs.

- :func:`plot_training` — training lm loss and held-out exact / token accuracy over steps;
- :func:`plot_rollout` — z_H and z_L decoded after every sub-step of one puzzle (figures 2-3);
- :func:`plot_freeze` — content change per sub-step, normal vs freeze-H vs freeze-L (figure 6);
- :func:`plot_locality` — per-layer L−H attention contrasts with 95% CIs (figures 8-9);
- :func:`write_report` — all four PNGs and ``summary.json`` from a run directory.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..figures import save_figure  # noqa: E402

__all__ = ["plot_freeze", "plot_locality", "plot_rollout", "plot_training", "write_report"]

_UNDECIDED, _WRONG, _RIGHT = (0.82, 0.82, 0.82), (0.90, 0.30, 0.30), (0.60, 0.85, 0.60)
_MAZE_RIGHT = {1: (0.25, 0.25, 0.30), 2: (1.0, 1.0, 1.0), 3: (0.2, 0.6, 0.2), 4: (0.2, 0.6, 0.2),
               5: (0.45, 0.75, 0.45)}  # correct WALL / OPEN / START / GOAL / PATH


def plot_training(log: dict[str, Any], path: str | os.PathLike) -> Path:
    """Training lm loss (left) and held-out exact / token accuracy (right) against the step."""
    history = log["history"]
    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, style in (("lm_loss", "-"), ("loss", ":")):
        points = [(h["step"], h[key]) for h in history if h.get(key) is not None]
        if points:
            ax_loss.plot(*zip(*points, strict=True), style, label=key)
    ax_loss.set(xlabel="training step", ylabel="loss", title="Training loss")
    if any(h.get("lm_loss", 0) > 0 for h in history):
        ax_loss.set_yscale("log")
    ax_loss.legend(fontsize=8)
    for key, label in (("exact_accuracy", "held-out exact"), ("token_accuracy", "held-out token"),
                       ("valid_optimal_accuracy", "held-out valid & optimal")):
        points = [(h["step"], h["eval"][key]) for h in history if key in (h.get("eval") or {})]
        if points:
            ax_acc.plot(*zip(*points, strict=True), "o-", ms=3, label=label)
    if any("train_exact_accuracy" in h for h in history):
        ax_acc.plot(steps, [h.get("train_exact_accuracy", math.nan) for h in history], "--",
                    label="train exact (batch)")
    task = log.get("train_config", {}).get("task", "")
    ax_acc.set(xlabel="training step", ylabel="accuracy", ylim=(-0.02, 1.02),
               title=f"Accuracy ({task})" if task else "Accuracy")
    ax_acc.legend(fontsize=8)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _cell_colours(tokens: np.ndarray, labels: np.ndarray, task: str) -> np.ndarray:
    undecided = 1 if task == "sudoku" else 0  # BLANK / PAD
    out = np.empty(tokens.shape + (3,))
    for i, (t, y) in enumerate(zip(tokens, labels, strict=True)):
        if t == undecided:
            out[i] = _UNDECIDED
        elif t != y:
            out[i] = _WRONG
        else:
            out[i] = _RIGHT if task == "sudoku" else _MAZE_RIGHT.get(int(t), _RIGHT)
    return out


def plot_rollout(model, input_ids, labels, task: str, path: str | os.PathLike,
                 segments: int = 2) -> Path:
    """Figures 2-3: z_H (top row) and z_L (bottom row) decoded after every sub-step of the first
    ``segments`` segments, for one puzzle (the first row of ``input_ids``). Cells are green when
    right, red when wrong, grey when undecided (BLANK for Sudoku, PAD for Maze); Sudoku digits
    are written in the cells, givens in bold."""
    import torch

    from modeling.air.analysis_air import rollout

    if task not in ("sudoku", "maze"):
        raise ValueError(f"task must be 'sudoku' or 'maze', got {task!r}")
    ids = torch.as_tensor(np.asarray(input_ids)).long().reshape(-1, model.config.seq_len)[:1]
    labels = np.asarray(labels).reshape(-1, model.config.seq_len)[0]
    given = ids[0].numpy() > 1 if task == "sudoku" else np.zeros(len(labels), bool)
    roll = rollout(model, ids, segments=segments)
    n = model.config.board_size
    states = [("z_H", roll.z_H)] + ([("z_L", roll.z_L)] if roll.z_L is not None else [])
    cols = len(roll.levels)
    fig, axes = plt.subplots(len(states), cols, figsize=(1.5 * cols, 1.6 * len(states) + 0.4),
                             squeeze=False)
    for r, (name, tokens) in enumerate(states):
        for c in range(cols):
            ax = axes[r][c]
            grid = tokens[c, 0].numpy()
            ax.imshow(_cell_colours(grid, labels, task).reshape(n, n, 3), interpolation="nearest")
            if task == "sudoku" and n <= 9:
                for k, t in enumerate(grid):
                    if t > 1:
                        ax.text(k % n, k // n, str(int(t) - 1), ha="center", va="center",
                                fontsize=max(4, 40 // n),
                                fontweight="bold" if given[k] else "normal")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"s{roll.segment[c] + 1}·{c % len(model.config.sub_steps) + 1} "
                             f"{roll.levels[c]}", fontsize=8)
            if c == 0:
                ax.set_ylabel(name)
    fig.suptitle(f"{task} rollout: green right, red wrong, grey undecided", fontsize=10)
    return save_figure(fig, path)


def plot_freeze(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Figure 6: mean content change between consecutive sub-steps for z_H (left) and z_L
    (right), normal vs freeze-H vs freeze-L (:func:`modeling.air.analysis_air.freeze_experiment`
    output); totals per puzzle in the legend."""
    modes = result["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, state in zip(axes[0], ("z_H", "z_L"), strict=True):
        for (name, mode), style in zip(modes.items(), ("-", "--", ":"), strict=False):
            stats = mode[state]
            if stats is None:
                continue
            x = np.arange(1, len(stats["curve"]) + 1)
            ax.plot(x, stats["curve"], style, marker=".", ms=4,
                    label=f"{name} (total {stats['total_mean']:.1f})")
        levels = result.get("levels") or []
        for t, level in enumerate(levels[1:], start=1):
            if level == "H":
                ax.axvline(t, color="0.85", lw=0.6, zorder=0)
        ax.set(xlabel="sub-step transition t → t+1", ylabel="changed positions (mean)",
               title=f"Content change of {state}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_locality(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Figures 8-9: each L−H contrast per layer, one series per query class, with 95% CIs
    (:func:`modeling.air.analysis_air.sudoku_attention_locality` / ``maze_attention_locality``
    output)."""
    stats = result["stats"]
    fig, axes = plt.subplots(1, len(stats), figsize=(3.2 * len(stats), 3.6), squeeze=False)
    for ax, (name, classes) in zip(axes[0], stats.items(), strict=True):
        for i, (cls, values) in enumerate(classes.items()):
            layers = np.arange(len(values["mean"])) + (i - 1) * 0.12
            ci = np.nan_to_num(np.asarray(values["ci95"], float))
            ax.errorbar(layers, values["mean"], yerr=ci, fmt="o", capsize=3, ms=4,
                        label=f"{cls} (n={result['queries'][cls]})")
        ax.axhline(0, color="k", lw=0.7)
        ax.set(xlabel="layer", title=name)
        ax.set_xticks(range(result["num_layers"]))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{result['task']}: L-update − H-update attention contrasts (95% CI)",
                 fontsize=10, y=1.03)
    return save_figure(fig, path)


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike, puzzles: int = 64,
                 segments: int | None = None) -> list[Path]:
    """Regenerate ``puzzles`` held-out puzzles of the run's task and size (``split="test"``,
    ``seed=0``), analyse ``run_dir/final`` on them (``segments`` segments, default the model's
    ``halt_max_steps``) and write ``training.png``, ``rollout.png``, ``freeze.png``,
    ``locality.png`` and ``summary.json`` to ``out_dir``. Returns the written paths."""
    import torch

    from modeling.air import AIRSolver
    from modeling.air import analysis_air as air

    run_dir, out = Path(run_dir), Path(out_dir)
    if not (run_dir / "log.json").is_file():
        raise ValueError(f"{run_dir} has no log.json; is it an air-train run directory?")
    if not (run_dir / "final" / "config.json").is_file():
        raise ValueError(f"{run_dir} has no final/ model (final/config.json missing)")
    log = json.loads((run_dir / "log.json").read_text())
    if "history" not in log:
        raise ValueError(f"{run_dir / 'log.json'} is not an air-train log (no 'history')")
    model = AIRSolver.from_pretrained(run_dir / "final").eval()
    task = log.get("train_config", {}).get("task", "sudoku")
    size = model.config.board_size
    if task == "sudoku":
        from modeling.air.sudoku_air import BLANK as undecided
        from modeling.air.sudoku_air import sudoku_dataset

        data = sudoku_dataset(size, puzzles, "test", seed=0)
    elif task == "maze":
        from modeling.air.maze_air import PAD as undecided
        from modeling.air.maze_air import maze_dataset

        data = maze_dataset(size, puzzles, "test", seed=0)
    else:
        raise ValueError(f"unknown task {task!r} in {run_dir / 'log.json'}")
    ids = torch.tensor(data["inputs"], dtype=torch.long)
    labels = torch.tensor(data["labels"], dtype=torch.long)
    pids = torch.tensor(data["puzzle_identifiers"], dtype=torch.long)

    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_training(log, out / "training.png"),
             plot_rollout(model, ids[:1], labels[:1], task, out / "rollout.png",
                          segments=min(2, segments or model.config.halt_max_steps))]
    roll = air.rollout(model, ids, segments, puzzle_identifiers=pids)
    predictions = roll.z_H[-1]
    summary: dict[str, Any] = {
        "task": task, "size": size, "puzzles": len(ids),
        "segments": segments or model.config.halt_max_steps,
        "exact_accuracy": float((predictions == labels).all(-1).double().mean()),
        "token_accuracy": float((predictions == labels).double().mean()),
        "undecided_fraction": {
            "levels": roll.levels,
            "z_H": air.undecided_fraction(roll.z_H, undecided).mean(1).tolist(),
            "z_L": (air.undecided_fraction(roll.z_L, undecided).mean(1).tolist()
                    if roll.z_L is not None else None)},
    }
    if task == "maze":
        from modeling.air.maze_air import valid_optimal_accuracy

        summary["valid_optimal_accuracy"] = valid_optimal_accuracy(ids.numpy(),
                                                                   predictions.numpy(), size)
    summary["freeze"] = air.freeze_experiment(model, ids, segments, puzzle_identifiers=pids)
    paths.append(plot_freeze(summary["freeze"], out / "freeze.png"))
    if task == "sudoku":
        summary["locality"] = air.sudoku_attention_locality(model, ids, size, segments,
                                                            puzzle_identifiers=pids)
    else:
        summary["locality"] = air.maze_attention_locality(model, ids, labels, size, segments,
                                                          puzzle_identifiers=pids)
    paths.append(plot_locality(summary["locality"], out / "locality.png"))
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=1, allow_nan=True))
    paths.append(summary_path)
    return paths
