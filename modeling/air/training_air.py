"""Training loop for the AIRSolver: the HRM recipe with the ACT carry persisting across batches.

A row of the carry keeps working on its puzzle until it halts; only then does it take the puzzle
at its index in the next batch. That is why this is a custom loop rather than ``Trainer``.
Optimiser: AdamATan2 (betas 0.9/0.95) with linear warmup and an optional cosine decay, weight
decay, optional parameter EMA for evaluation. ``accelerate`` places the model and the batches;
under ``accelerate launch`` the run is data parallel: ``batch_size`` is the global batch, each
process trains on (and carries the ACT state of) its equal share of the rows, gradients and the
logged values are averaged across processes, and only the main process writes. Every row's
segment is independent of the others' and the losses are means over rows, so a step equals the
one-process step up to float summation order — except that each process draws its own ACT
exploration numbers (same distribution, not the same numbers as one process would draw).
Evaluation runs :meth:`AIRSolver.solve` to the segment limit (as the papers do) and reports exact
accuracy, token accuracy and, for mazes, the fraction of valid and optimal paths. The JSON log is
rewritten atomically at every evaluation.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration

from ..checkpoints import save_pretrained_atomically, write_json
from .maze_air import valid_optimal_accuracy
from .modeling_air import AIRSolver
from .optim_air import EMA, AdamATan2, make_scheduler

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency of the package
    tqdm = None

__all__ = ["AIRTrainConfig", "compile_recurrent_blocks", "evaluate_air", "train_air"]

TASKS = ("sudoku", "maze")
_COLUMNS = ("inputs", "labels", "puzzle_identifiers")
SAMPLINGS = ("example", "group")


@dataclass
class AIRTrainConfig:
    """Optimisation and bookkeeping (defaults: the paper's Sudoku recipe, appendix A).

    ``lr_min_ratio`` < 1 adds a cosine decay after warmup (1.0: constant). ``ema_decay`` None
    disables the EMA; otherwise evaluation uses the averaged weights. ``threads``: torch intra-op
    threads (None leaves torch's default). ``eval_every`` = 0 evaluates only at the end.
    ``sampling``: ``"example"`` draws every row once per epoch; ``"group"`` draws one row of
    each ``group`` (one augmented copy per base puzzle) per epoch, as the authors' sampler does
    (the dataset needs a ``group`` column: :func:`load_puzzle_folder`, :func:`sudoku_dataset`).
    ``compile``: wrap the recurrent block(s) in ``torch.compile`` (inductor) for training; the
    same function up to float rounding, 1.25x per step on a 2-core CPU
    (``benchmarks/air/training_step.py``); costs a compilation at the first steps.
    """

    task: str = "sudoku"
    steps: int = 20_000
    batch_size: int = 768
    lr: float = 1e-4
    lr_min_ratio: float = 1.0
    warmup_steps: int = 2000
    weight_decay: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    atan2_a: float = 1.27
    atan2_b: float = 1.0
    ema_decay: float | None = None
    eval_every: int = 1000
    eval_batch_size: int = 512
    eval_max_segments: int | None = None
    seed: int = 0
    threads: int | None = None
    mixed_precision: str = "no"
    cpu: bool = False
    progress: bool = True
    sampling: str = "example"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"AIRTrainConfig.task must be one of {TASKS}, got {self.task!r}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"AIRTrainConfig.sampling must be one of {SAMPLINGS}, got "
                             f"{self.sampling!r}")
        for name in ("steps", "batch_size", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AIRTrainConfig.{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"AIRTrainConfig.{name} must be an integer >= 0, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"AIRTrainConfig.lr must be a finite number > 0, got {self.lr!r}")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError("AIRTrainConfig.mixed_precision must be 'no', 'bf16' or 'fp16', "
                             f"got {self.mixed_precision!r}")


def _tensors(dataset, seq_len: int) -> dict[str, torch.Tensor]:
    """The dataset's model columns as tensors, checked against the model's sequence length."""
    missing = [column for column in _COLUMNS if column not in dataset.column_names]
    if missing:
        raise ValueError(f"the dataset lacks the column(s) {missing}; AIR datasets have "
                         f"{list(_COLUMNS)}")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    data = dataset.with_format("torch", columns=list(_COLUMNS))[:]
    if data["inputs"].shape[1] != seq_len:
        raise ValueError(f"the dataset's puzzles have {data['inputs'].shape[1]} cells but the "
                         f"model's config.seq_len is {seq_len}")
    return {name: data[name].long() for name in _COLUMNS}


@torch.no_grad()
def evaluate_air(model: AIRSolver, dataset, task: str = "sudoku", batch_size: int = 512,
                 max_segments: int | None = None, halting: str = "max") -> dict[str, float]:
    """Solve every puzzle of ``dataset`` and score it.

    Returns ``exact_accuracy`` (every cell right), ``token_accuracy`` (cells right, over all
    cells, as HRM reports it), ``mean_segments`` and, for mazes, ``valid_optimal_accuracy`` (the
    predicted path is a valid shortest path, whichever of the equal-length paths it is).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return _score(model, _tensors(dataset, model.config.seq_len), task, batch_size, max_segments,
                  halting)


def _score(model: AIRSolver, data: dict[str, torch.Tensor], task: str, batch_size: int,
           max_segments: int | None, halting: str = "max") -> dict[str, float]:
    """:func:`evaluate_air` on the dataset's tensors (converted once per training run)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    exact = tokens = segments = 0.0
    predictions = []
    count = data["inputs"].shape[0]
    for start in range(0, count, batch_size):
        ids = data["inputs"][start:start + batch_size].to(device)
        labels = data["labels"][start:start + batch_size].to(device)
        pid = data["puzzle_identifiers"][start:start + batch_size].to(device)
        solution = model.solve(ids, puzzle_identifiers=pid, max_segments=max_segments,
                               halting=halting)
        right = solution.predictions == labels
        exact += right.all(-1).sum().item()
        tokens += right.float().mean(-1).sum().item()
        segments += solution.segments.sum().item()
        if task == "maze":
            predictions.append(solution.predictions.cpu())
    model.train(was_training)
    metrics = {"exact_accuracy": exact / count, "token_accuracy": tokens / count,
               "mean_segments": segments / count, "count": count}
    if task == "maze":
        metrics["valid_optimal_accuracy"] = valid_optimal_accuracy(
            data["inputs"].numpy(), torch.cat(predictions).numpy(), model.config.board_size)
    return metrics


def _batches(count: int, batch_size: int, generator: torch.Generator):
    """Endless shuffled epochs of index batches (the last partial batch of an epoch is dropped
    unless the whole set is smaller than a batch, which is then drawn with replacement)."""
    while True:
        if count < batch_size:
            yield torch.randint(0, count, (batch_size,), generator=generator)
            continue
        order = torch.randperm(count, generator=generator)
        for start in range(0, count - batch_size + 1, batch_size):
            yield order[start:start + batch_size]


def _group_batches(groups: torch.Tensor, batch_size: int, generator: torch.Generator):
    """Endless epochs that draw one random row of every group, in a shuffled group order, cut
    into batches (the last partial batch of an epoch is dropped unless there are fewer groups
    than a batch, which are then drawn with replacement)."""
    labels, group_of_row = torch.unique(groups, return_inverse=True)
    order = torch.argsort(group_of_row, stable=True)
    sizes = torch.bincount(group_of_row, minlength=len(labels))
    starts = torch.cumsum(sizes, 0) - sizes

    def pick(chosen: torch.Tensor) -> torch.Tensor:
        offsets = (torch.rand(len(chosen), generator=generator) * sizes[chosen]).long()
        return order[starts[chosen] + offsets]

    while True:
        if len(labels) < batch_size:
            yield pick(torch.randint(0, len(labels), (batch_size,), generator=generator))
            continue
        rows = pick(torch.randperm(len(labels), generator=generator))
        for start in range(0, len(rows) - batch_size + 1, batch_size):
            yield rows[start:start + batch_size]


def compile_recurrent_blocks(solver: AIRSolver) -> None:
    """Compile, in place, the block(s) every L and H update of a segment calls.

    ``nn.Module.compile`` keeps parameter names, so checkpoints and ``save_pretrained`` are
    unchanged; the solver stays compiled after training (``torch.compiler.reset()`` drops the
    compiled graphs).
    """
    for block in {id(block): block for block in map(solver.block_for, ("L", "H"))}.values():
        block.compile()


def train_air(model: AIRSolver, train_dataset, eval_dataset=None,
              config: AIRTrainConfig | None = None, out: str | os.PathLike | None = None,
              card: Callable[[dict[str, Any], str], str] | None = None) -> dict[str, Any]:
    """Train ``model`` in place on ``train_dataset``; evaluate on ``eval_dataset``.

    Returns the log: the configs, ``history`` (one entry per evaluation with the step, the
    training loss parts averaged since the last evaluation, the evaluation metrics and the wall
    time) and ``final``. With ``out``, writes ``out/log.json`` at every evaluation and the final
    model as ``out/final`` (a ``save_pretrained`` directory), with ``card(log, run_name)`` as its
    README when given (``hub_cards.air_card.render_air_card`` is the model card of ``air-train``).
    """
    config = config or AIRTrainConfig()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    data = _tensors(train_dataset, model.config.seq_len)
    # split_batches: batch_size is the global batch, so the scheduler steps once per step
    accelerator = Accelerator(cpu=config.cpu, mixed_precision=config.mixed_precision,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    world, rank, main = (accelerator.num_processes, accelerator.process_index,
                         accelerator.is_main_process)
    if config.batch_size % world:
        raise ValueError(f"AIRTrainConfig.batch_size {config.batch_size} is the global batch and "
                         f"must be a multiple of the {world} processes (each trains on an equal "
                         "share)")
    optimizer = AdamATan2(model.parameters(), lr=config.lr, betas=config.betas,
                          weight_decay=config.weight_decay, a=config.atan2_a, b=config.atan2_b)
    scheduler = make_scheduler(optimizer, config.warmup_steps, max(config.steps,
                                                                   config.warmup_steps),
                               config.lr_min_ratio)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    solver = accelerator.unwrap_model(model)
    if config.compile:
        compile_recurrent_blocks(solver)
    ema = EMA(solver, config.ema_decay) if config.ema_decay is not None else None
    out_dir = Path(out) if out is not None else None
    if out_dir is not None and main:
        out_dir.mkdir(parents=True, exist_ok=True)
    log: dict[str, Any] = {"train_config": asdict(config), "model_config": solver.config.to_dict(),
                           "train_size": int(data["inputs"].shape[0]),
                           "eval_size": len(eval_dataset) if eval_dataset is not None else 0,
                           "history": []}

    eval_data = (_tensors(eval_dataset, solver.config.seq_len)
                 if eval_dataset is not None else None)

    def evaluate() -> dict[str, float]:
        if eval_data is None:
            return {}
        if ema is None:
            return _score(solver, eval_data, config.task, config.eval_batch_size,
                          config.eval_max_segments)
        with ema.swapped(solver):
            return _score(solver, eval_data, config.task, config.eval_batch_size,
                          config.eval_max_segments)

    generator = torch.Generator().manual_seed(config.seed)
    if config.sampling == "group":
        if "group" not in train_dataset.column_names:
            raise ValueError("sampling='group' needs a 'group' column (load_puzzle_folder and "
                             "sudoku_dataset give one)")
        batches = _group_batches(torch.as_tensor(train_dataset["group"]), config.batch_size,
                                 generator)
    else:
        batches = _batches(data["inputs"].shape[0], config.batch_size, generator)
    carry = None
    running: dict[str, float] = {}
    since = 0
    start_time = time.perf_counter()
    bar = tqdm(total=config.steps, desc="air-train", disable=not config.progress or None) \
        if tqdm is not None and main else None
    model.train()
    for step in range(1, config.steps + 1):
        index = next(batches).view(world, -1)[rank]  # this process's rows of the global batch
        batch = {name: tensor[index].to(accelerator.device) for name, tensor in data.items()}
        output = model(batch["inputs"], labels=batch["labels"], carry=carry,
                       puzzle_identifiers=batch["puzzle_identifiers"])
        carry = output.carry
        accelerator.backward(output.loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(solver)
        parts = {"loss": output.loss, "lm_loss": output.lm_loss, "q_halt_loss": output.q_halt_loss,
                 "train_exact_accuracy": output.is_correct.float().mean(),
                 "halted_fraction": carry.halted.float().mean()}
        if output.q_continue_loss is not None:
            parts["q_continue_loss"] = output.q_continue_loss
        values = torch.stack([value.detach().float() for value in parts.values()])
        if world > 1:
            values = accelerator.reduce(values, reduction="mean")
        for name, value in zip(parts, values.tolist(), strict=True):
            running[name] = running.get(name, 0.0) + value
        since += 1
        if not math.isfinite(float(values[0])):
            raise FloatingPointError(f"the training loss became {float(values[0])} "
                                     f"at step {step}; lower the learning rate")
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{running['loss'] / since:.3f}")
        if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
            entry = {"step": step, "lr": scheduler.get_last_lr()[0],
                     **{name: value / since for name, value in running.items()},
                     "eval": evaluate(), "wall_time_s": time.perf_counter() - start_time}
            log["history"].append(entry)
            running, since = {}, 0
            if bar is not None and config.progress and entry["eval"]:
                bar.write(f"step {step}: loss {entry['loss']:.4f} eval exact "
                          f"{entry['eval']['exact_accuracy']:.4f}")
            if out_dir is not None and main:
                write_json(out_dir / "log.json", log)
    if bar is not None:
        bar.close()
    log["final"] = log["history"][-1]
    if out_dir is not None:
        if ema is not None:
            ema.copy_to(solver)
        def add_card(folder: Path) -> None:
            if card is not None and main:
                (folder / "README.md").write_text(card(log, out_dir.name))

        save_pretrained_atomically(solver, out_dir / "final", add_files=add_card,
                                   accelerator=accelerator)
        if main:
            write_json(out_dir / "log.json", log)
    return log
