"""Evaluation tasks for the project's own model families, on any model a user points at.

``air-sudoku`` / ``air-maze``: held-out puzzles generated offline at the model's board size
(the ``test`` split of the generators ``air-train`` uses, so disjoint from a run trained with the
same data seed), solved to the segment limit; exact, token and (mazes) valid-and-optimal path
accuracy. ``arith-splits``: exact-answer accuracy on every pool of the paper (0/1/2-variable
splits, held-out pairs, restricted variables and the curated pools) plus the appendix-B progress
measures.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .names import FAMILY_TASKS

__all__ = ["family_fingerprint", "load_family_model", "run_air_puzzles",
           "run_arith_splits"]

def load_family_model(name: str, task: str):
    """An AIRSolver / ArithTransformer from a folder or a Hub repo id (``trust_remote_code``)."""
    from transformers import AutoConfig, AutoModel

    import modeling  # noqa: F401  (registers the families with the Auto classes)

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=True)
        model = AutoModel.from_pretrained(name, trust_remote_code=True).eval()
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load model {name!r}: {str(error).splitlines()[0]}") from None
    if config.model_type != FAMILY_TASKS[task]:
        raise ValueError(f"{task} needs an {FAMILY_TASKS[task]} model; {name!r} is "
                         f"{config.model_type!r}")
    model.name_or_path = model.config.name_or_path = str(name)
    return model


def family_fingerprint(model) -> dict[str, Any]:
    """What identifies the evaluated model in a results file: type, name, depth, weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return {"model_type": model.config.model_type,
            "name_or_path": str(getattr(model.config, "name_or_path", "") or ""),
            "num_hidden_layers": int(model.config.num_hidden_layers),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "weights_digest": digest.hexdigest()[:16]}


def run_air_puzzles(model, task: str, *, puzzles: int, seed: int,
                    batch_size: int = 256) -> dict[str, Any]:
    """Solve ``puzzles`` held-out puzzles of the model's board size and score them."""
    from modeling.air.maze_air import maze_dataset
    from modeling.air.sudoku_air import sudoku_dataset
    from modeling.air.training_air import evaluate_air

    kind = task.removeprefix("air-")
    size = model.config.board_size
    make = sudoku_dataset if kind == "sudoku" else maze_dataset
    try:
        data = make(size, puzzles, "test", seed=seed)
    except ValueError as error:
        raise ValueError(f"{task}: cannot generate {size}x{size} puzzles for this model: "
                         f"{error}") from None
    metrics = evaluate_air(model, data, kind, batch_size=batch_size)
    return {"metrics": metrics, "puzzles": len(data), "board_size": size,
            "data": {"generator": f"modeling.air.{kind}_air", "split": "test", "seed": seed}}


def run_arith_splits(model, *, pool_size: int, seed: int,
                     held_out_split: str = "authors") -> dict[str, Any]:
    """Accuracy on every pool and the progress measures of ``model``."""
    from modeling.arith import ArithTask
    from modeling.arith.data_arith import sample_batch
    from modeling.arith.progress_arith import progress_measures
    from modeling.arith.training_arith import evaluate_pools, make_pools

    config = model.config
    task = ArithTask(modulus=config.modulus, num_variables=config.num_variables,
                     seq_len=config.max_position_embeddings, held_out_split=held_out_split)
    pools = make_pools(task, pool_size, seed=seed, held_out=task.held_out_mask())
    accuracy = evaluate_pools(model, pools)
    probe = sample_batch(task, 1024, torch.Generator().manual_seed(seed + 7))
    with torch.no_grad():
        progress = progress_measures(model, task, probe)
    return {"metrics": accuracy, "pool_size": pool_size, "held_out_split": held_out_split,
            "progress": {k: float(v) for k, v in progress.items()}}
