"""Language-model training for ASM and its matched Transformer, one loop for both.

AdamW (weight decay on matrices and embeddings only), linear warmup then cosine decay to
``min_lr_ratio`` x ``lr``, gradient clipping, bf16 autocast where the accelerator has it
(``mixed_precision="auto"``), validation perplexity every ``eval_every`` steps. ``accelerate``
places model and batches, so the same call runs under ``accelerate launch`` in several processes
(data parallel): ``batch_size`` is the global batch, each process trains on its equal share of
it (gradients averaged across processes, so a step equals the one-process step on the whole
batch up to float summation order), the logged loss is the mean over processes, and only the
main process writes logs and models.

Batches are a pure function of the step: epoch ``e`` visits the blocks in the order of
``torch.randperm(N, generator=seed + e)``, so two models trained with one seed see the same tokens
in the same order, and a resumed run continues exactly where the checkpoint left off.
``out/checkpoint`` (model, optimiser, scheduler and RNG state via ``accelerator.save_state``) and
``out/log.json`` are replaced atomically every ``save_every`` steps; ``out/final`` is a
``save_pretrained`` folder (with the tokenizer when given).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration

from ..checkpoints import save_pretrained_atomically, write_json

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency of the package
    tqdm = None

__all__ = ["LMTrainConfig", "batch_order", "evaluate_nll", "train_lm"]

PRECISIONS = ("auto", "no", "bf16", "fp16")


@dataclass
class LMTrainConfig:
    """Optimisation and bookkeeping of :func:`train_lm` (``eval_every``/``save_every`` 0: only
    at the end; ``eval_blocks``: validation blocks scored, 0 for all)."""

    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_blocks: int = 0
    eval_batch_size: int = 32
    save_every: int = 200
    seed: int = 0
    mixed_precision: str = "auto"
    cpu: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LMTrainConfig.{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "eval_every", "eval_blocks", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LMTrainConfig.{name} must be an integer >= 0, got {value!r}")
        for name, low in (("lr", 0.0), ("grad_clip", 0.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > low):
                raise ValueError(f"LMTrainConfig.{name} must be a finite number > 0, got "
                                 f"{value!r}")
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"LMTrainConfig.min_lr_ratio must be in [0, 1], got "
                             f"{self.min_lr_ratio!r}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"LMTrainConfig.mixed_precision must be one of {PRECISIONS}, got "
                             f"{self.mixed_precision!r}")


def batch_order(num_blocks: int, batch_size: int, seed: int, first_step: int = 1
                ) -> Iterator[torch.Tensor]:
    """Block indices of steps ``first_step, first_step + 1, ...`` (see the module docstring);
    an epoch's last incomplete batch is dropped.

    Raises:
        ValueError: fewer blocks than one batch.
    """
    per_epoch = num_blocks // batch_size
    if per_epoch == 0:
        raise ValueError(f"{num_blocks} training blocks are fewer than one batch of {batch_size}")
    step = first_step
    while True:
        epoch, first = divmod(step - 1, per_epoch)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + epoch))
        for index in range(first, per_epoch):
            yield order[index * batch_size:(index + 1) * batch_size]
            step += 1


@torch.no_grad()
def evaluate_nll(model, blocks: torch.Tensor, batch_size: int = 32) -> dict[str, float]:
    """Mean next-token NLL (nats) and perplexity of ``model`` over ``blocks [N, T]``, every
    position but the first of each block scored; the model stays where it is."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, blocks.shape[0], batch_size):
        batch = blocks[start:start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"))
        count += batch[:, 1:].numel()
    model.train(was_training)
    nll = total / count
    return {"nll": nll, "perplexity": math.exp(nll), "tokens": count}


def _precision(requested: str, cpu: bool) -> str:
    """``"auto"``: the precision ``accelerate launch --mixed_precision`` asked for, else bf16
    where the GPU has it, else none; any other value is used as given."""
    if requested != "auto":
        return requested
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched in PRECISIONS:
        return launched
    bf16 = not cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return "bf16" if bf16 else "no"


def _optimizer(model, config: LMTrainConfig) -> torch.optim.AdamW:
    decay, rest = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else rest).append(parameter)
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=config.lr, betas=config.betas)


def _schedule(optimizer, config: LMTrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_lm(model, train_blocks: torch.Tensor, val_blocks: torch.Tensor | None = None,
             config: LMTrainConfig | None = None, out: str | os.PathLike | None = None,
             tokenizer=None, resume: bool = True) -> dict[str, Any]:
    """Train the causal LM ``model`` in place on ``train_blocks [N, T]`` (int64 token ids).

    Returns the log: configs, parameter count, ``history`` (per evaluation: step, tokens seen,
    learning rate, mean training loss since the last entry, validation NLL / perplexity, wall
    time) and ``final``. With ``out`` and ``resume``, a run whose ``out/checkpoint`` exists
    continues from it (same configs required).

    Raises:
        ValueError: blocks that are not 2-D int64 with at least 2 positions, token ids outside
            the model's vocabulary, a checkpoint written under another config, or a batch size
            that the processes of an ``accelerate launch`` cannot share equally.
        FloatingPointError: the training loss became NaN or infinite.
    """
    config = config or LMTrainConfig()
    for name, blocks in (("train_blocks", train_blocks), ("val_blocks", val_blocks)):
        if blocks is None:
            continue
        if blocks.dtype != torch.int64 or blocks.ndim != 2 or blocks.shape[1] < 2:
            raise ValueError(f"{name} must be an int64 tensor [N, T] with T >= 2, got "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        if blocks.numel() and (int(blocks.min()) < 0
                               or int(blocks.max()) >= model.config.vocab_size):
            raise ValueError(f"{name} holds token ids outside [0, {model.config.vocab_size}) "
                             "(a tokenizer that does not match the model's vocab_size?)")
    order = batch_order(train_blocks.shape[0], config.batch_size, config.seed)
    # split_batches: batch_size is the global batch, so the scheduler steps once per step
    # (accelerate otherwise steps it once per process, assuming per-process batches)
    accelerator = Accelerator(cpu=config.cpu,
                              mixed_precision=_precision(config.mixed_precision, config.cpu),
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    world, rank, main = (accelerator.num_processes, accelerator.process_index,
                         accelerator.is_main_process)
    if config.batch_size % world:
        raise ValueError(f"LMTrainConfig.batch_size {config.batch_size} is the global batch and "
                         f"must be a multiple of the {world} processes (each trains on an equal "
                         "share)")
    torch.manual_seed(config.seed)
    optimizer = _optimizer(model, config)
    scheduler = _schedule(optimizer, config)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    bare = accelerator.unwrap_model(model)
    out_dir = Path(out) if out is not None else None
    log: dict[str, Any] = {
        "train_config": asdict(config), "model_config": bare.config.to_dict(),
        "model_class": type(bare).__name__,
        "num_parameters": sum(p.numel() for p in {id(p): p for p in bare.parameters()}.values()),
        "train_blocks": list(train_blocks.shape),
        "val_blocks": list(val_blocks.shape) if val_blocks is not None else None,
        "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device),
        "history": []}
    first_step, elapsed = 1, 0.0
    checkpoint = out_dir / "checkpoint" if out_dir is not None else None
    if out_dir is not None and main:
        out_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint is not None and resume and (checkpoint / "trainer_log.json").is_file():
        saved = json.loads((checkpoint / "trainer_log.json").read_text())
        for key in ("train_config", "model_config", "train_blocks"):
            if saved[key] != json.loads(json.dumps(log[key])):
                raise ValueError(f"{checkpoint} was written with another {key}; pass another "
                                 "output directory or resume=False")
        accelerator.load_state(str(checkpoint / "state"))
        log, first_step, elapsed = saved, saved["step"] + 1, saved["wall_time_s"]
        order = batch_order(train_blocks.shape[0], config.batch_size, config.seed, first_step)
    if val_blocks is not None and config.eval_blocks:
        val_blocks = val_blocks[:config.eval_blocks]

    def save(step: int) -> None:
        log["step"] = step
        log["wall_time_s"] = elapsed + time.perf_counter() - start

        def add_state(folder: Path) -> None:
            accelerator.save_state(str(folder / "state"), safe_serialization=True)
            if main:
                write_json(folder / "trainer_log.json", log)

        save_pretrained_atomically(bare, checkpoint, add_files=add_state,
                                   accelerator=accelerator)
        if main:
            write_json(out_dir / "log.json", log)

    start = time.perf_counter()
    bar = None
    if tqdm is not None and config.progress and main:
        bar = tqdm(total=config.steps, initial=first_step - 1, desc=f"train {type(bare).__name__}")
    running, since = 0.0, 0
    model.train()
    for step in range(first_step, config.steps + 1):
        share = next(order).view(world, -1)[rank]  # this process's part of the global batch
        batch = train_blocks[share].to(accelerator.device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(accelerator.reduce(loss.detach(), reduction="mean"))
        if not math.isfinite(value):
            raise FloatingPointError(f"the training loss became {value} at step {step}; lower "
                                     "the learning rate")
        running, since = running + value, since + 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{running / since:.3f}", refresh=False)
        last = step == config.steps
        if (config.eval_every and step % config.eval_every == 0) or last:
            entry = {"step": step, "tokens": step * config.batch_size * train_blocks.shape[1],
                     "lr": scheduler.get_last_lr()[0], "train_loss": running / since,
                     "wall_time_s": elapsed + time.perf_counter() - start}
            if val_blocks is not None:
                entry["validation"] = evaluate_nll(bare, val_blocks, config.eval_batch_size)
                if bar is not None:
                    bar.write(f"step {step}: train loss {entry['train_loss']:.3f}, validation "
                              f"perplexity {entry['validation']['perplexity']:.2f}")
            log["history"].append(entry)
            running, since = 0.0, 0
        if checkpoint is not None and ((config.save_every and step % config.save_every == 0)
                                       or last):
            save(step)
    if bar is not None:
        bar.close()
    log["final"] = log["history"][-1] if log["history"] else None
    if out_dir is not None:
        def add(folder: Path) -> None:
            if tokenizer is not None and main:
                tokenizer.save_pretrained(folder)

        save_pretrained_atomically(bare, out_dir / "final", add_files=add,
                                   accelerator=accelerator)
        if main:
            write_json(out_dir / "log.json", log)
    return log
