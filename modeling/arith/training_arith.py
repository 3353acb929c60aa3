"""Training loop for the ArithTransformer: AdamW on an on-the-fly stream, pool evaluation,
progress measures, checkpoints and a JSON log.

The log (``log.json`` in ``out``) is rewritten atomically at every evaluation, so a run can be
plotted while it trains or after it was stopped.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import save_pretrained_atomically, write_json
from .configuration_arith import ArithConfig
from .data_arith import CURATED_POOLS, POOLS, ArithTask, sample_batch, sample_pool
from .modeling_arith import ArithTransformer
from .progress_arith import progress_measures

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency of the package
    tqdm = None

__all__ = ["TrainConfig", "evaluate_pools", "make_pools", "train_arith"]

LOG_FORMAT_VERSION = 1


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping (defaults: the paper's run).

    ``threads``: torch intra-op threads (None leaves torch's default). ``bf16``: CPU/GPU bf16
    autocast for the forward pass. ``checkpoint_every`` = 0 keeps only the final checkpoint.
    """

    steps: int = 30_000
    batch_size: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.02
    betas: tuple[float, float] = (0.9, 0.999)
    eval_every: int = 500
    eval_pool_size: int = 1024
    final_pool_size: int = 8192
    probe_batch_size: int = 1024
    checkpoint_every: int = 0
    seed: int = 0
    threads: int | None = None
    bf16: bool = False
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_pool_size", "final_pool_size",
                     "probe_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 1, got {value!r}")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"TrainConfig.checkpoint_every must be >= 0, got {self.checkpoint_every}"
            )
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"TrainConfig.threads must be >= 1, got {self.threads}")
        self.betas = tuple(self.betas)


def make_pools(
    task: ArithTask, size: int, seed: int, held_out: torch.Tensor | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Every split pool and curated pool, ``size`` sequences each, each with its own seed.

    Pools that cannot exist under ``task`` are left out: held-out-pair pools when no pair is
    held out, var-restricted pools when an operand side has no restricted variable.
    """
    held_out = task.held_out_mask() if held_out is None else held_out
    restricted = bool(task.no_lhs_variables and task.no_rhs_variables)
    specs = {**POOLS, **CURATED_POOLS}
    return {name: sample_pool(task, spec, size, seed + 1000 * i, held_out)
            for i, (name, spec) in enumerate(specs.items())
            if (spec.pairs != "held_out" or held_out.any())
            and (spec.bad_positions == 0 or restricted)}


@torch.no_grad()
def evaluate_pools(
    model: ArithTransformer, pools: dict[str, dict[str, torch.Tensor]], batch_size: int = 4096
) -> dict[str, float]:
    """Exact-answer accuracy of the last position on each pool."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    result = {}
    for name, pool in pools.items():
        correct = 0
        for start in range(0, len(pool["labels"]), batch_size):
            ids = pool["input_ids"][start:start + batch_size].to(device)
            logits = model(ids, logits_to_keep=1).logits[:, -1]
            correct += (logits.argmax(-1).cpu() == pool["labels"][start:start + batch_size]).sum()
        result[name] = int(correct) / len(pool["labels"])
    model.train(was_training)
    return result


def _evaluation_copy(model: ArithTransformer) -> ArithTransformer:
    """A CPU copy of ``model`` for the periodic evaluation (the pools and the progress measures
    run on the CPU). ``Module.to`` moves a module in place, so evaluating the training model
    itself would leave a model training on a GPU on the CPU; whatever the evaluation does to its
    copy (mode, device, dtype) never reaches the training model or its optimizer."""
    return copy.deepcopy(model).to("cpu")


def train_arith(
    config: ArithConfig | None = None,
    task: ArithTask | None = None,
    train: TrainConfig | None = None,
    out: str | os.PathLike | None = None,
) -> tuple[ArithTransformer, dict[str, Any]]:
    """Train from scratch; return ``(model, log)``.

    The log holds the configs, ``history`` (one entry per evaluation: ``step``, mean training
    ``loss`` since the previous entry, ``accuracy`` by pool, ``progress`` measures,
    ``elapsed_s``) and ``final`` (accuracy on larger pools). With ``out``, writes
    ``out/log.json``, ``out/checkpoint-<step>/`` every ``checkpoint_every`` steps and
    ``out/final/`` (``save_pretrained`` directories; ``task.json`` beside the log).
    """
    config = config or ArithConfig()
    task = task or ArithTask()
    train = train or TrainConfig()
    if config.modulus != task.modulus or config.num_variables != task.num_variables:
        raise ValueError("ArithConfig and ArithTask disagree on modulus / num_variables")
    if config.max_position_embeddings < task.seq_len:
        raise ValueError(
            f"ArithConfig.max_position_embeddings ({config.max_position_embeddings}) is shorter "
            f"than ArithTask.seq_len ({task.seq_len})"
        )
    if train.threads is not None:
        torch.set_num_threads(train.threads)
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "task.json", task.to_dict())

    torch.manual_seed(train.seed)
    device = torch.device(train.device)
    model = ArithTransformer(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr,
                                  weight_decay=train.weight_decay, betas=train.betas)
    held_out = task.held_out_mask()
    stream = torch.Generator().manual_seed(train.seed)
    pools = make_pools(task, train.eval_pool_size, seed=10_000 + train.seed, held_out=held_out)
    probe_batch = sample_batch(task, train.probe_batch_size,
                               torch.Generator().manual_seed(20_000 + train.seed),
                               held_out=held_out)
    log: dict[str, Any] = {
        "format_version": LOG_FORMAT_VERSION,
        "model_config": config.to_dict(),
        "task": task.to_dict(),
        "train": asdict(train),
        "threads": torch.get_num_threads(),
        "history": [],
    }
    start = time.perf_counter()
    running, count = 0.0, 0

    def record(step: int) -> None:
        evaluated = _evaluation_copy(model)
        entry = {
            "step": step,
            "loss": running / count if count else None,
            "accuracy": evaluate_pools(evaluated, pools),
            "progress": progress_measures(evaluated, task, probe_batch),
            "elapsed_s": time.perf_counter() - start,
        }
        del evaluated
        log["history"].append(entry)
        if out_dir is not None:
            write_json(out_dir / "log.json", log)

    record(0)
    bar = tqdm(total=train.steps, desc="arith", disable=not train.progress) if tqdm else None
    for step in range(1, train.steps + 1):
        batch = sample_batch(task, train.batch_size, stream, held_out=held_out)
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train.bf16):
            loss = model(ids, labels=labels, logits_to_keep=1).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running += loss.item()
        count += 1
        if bar is not None:
            bar.update(1)
        if step % train.eval_every == 0 or step == train.steps:
            record(step)
            running, count = 0.0, 0
            if bar is not None:
                acc = log["history"][-1]["accuracy"]
                bar.set_postfix(loss=f"{log['history'][-1]['loss']:.3f}",
                                min_acc=f"{min(acc.values()):.3f}")
        if out_dir is not None and train.checkpoint_every and step % train.checkpoint_every == 0:
            save_pretrained_atomically(model, out_dir / f"checkpoint-{step}")
    if bar is not None:
        bar.close()
    final_pools = make_pools(task, train.final_pool_size, seed=30_000 + train.seed,
                             held_out=held_out)
    log["final"] = {"step": train.steps, "accuracy": evaluate_pools(model, final_pools),
                    "pool_size": train.final_pool_size,
                    "wall_time_s": time.perf_counter() - start}
    if out_dir is not None:
        save_pretrained_atomically(model, out_dir / "final")
        write_json(out_dir / "log.json", log)
    model.eval()
    return model, log
