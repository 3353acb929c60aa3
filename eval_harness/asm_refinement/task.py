"""``asm-refinement``: the refinement geometry and interventions of the ASM paper (sections 4-6)
on a trained ASMForCausalLM, over held-out blocks of the offline corpus.

Data: the ``validation`` chapters of :func:`modeling.asm.corpus_asm.kjv_corpus` (never trained
on by ``asm-train``), packed into blocks of the model's context (``max_position_embeddings``)
with the model's own tokenizer; the first ``blocks`` blocks are used.

- Geometry (figure 1): ``alpha = <g Delta, o> / ||o||^2``, ``||(g Delta)_perp|| / ||g Delta||``
  and ``||g Delta|| / ||o||`` at every (block, head, position) of every layer; histograms of a
  seeded sample of ``samples`` of them pooled over layers (the paper samples 200k positions) and
  medians overall and per layer. (The gate ``g`` is part of the refinement the model adds; the
  paper writes Delta for the added term.)
- Interventions (figures 2-3): mean next-token NLL under ``default``, ``parallel_only``,
  ``orthogonal_only`` and ``none`` (first-order read only) at every layer, and the first two at
  one layer at a time; ``delta`` is the change from ``default``.
- beta sweep (figure 4): the orthogonal part scaled by each beta at every layer.
- Section 5: slot write half-lives at the last position of each block, slot-usage ESS per layer
  and, per head, routing inertia against refinement strength (mean ``||g Delta|| / ||o||``)
  with their Pearson and Spearman correlations.
- ``claims``: the paper's statements as measured booleans (alpha median < 0, orthogonal
  fraction median < 0.5, orthogonal-only worse than parallel-only, some beta in (0, 1] at least
  as good as beta = 0, orthogonal-only costs most at layer 0, slot ESS U-shaped over depth: an
  inner layer below both ends, and a negative inertia-strength correlation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DEFAULT_BETAS", "run_asm_refinement"]

DEFAULT_BETAS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
_GEOMETRY = ("alpha", "orthogonal_fraction", "relative_magnitude")


def _nll(model, blocks: torch.Tensor, batch_size: int) -> float:
    from modeling.asm.training_asm import evaluate_nll

    return evaluate_nll(model, blocks, batch_size)["nll"]


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rank = lambda v: v.argsort().argsort().double()  # noqa: E731 (no ties in float statistics)
    return _pearson(rank(x), rank(y))


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    levels = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    return {f"p{round(100 * float(q))}": float(v)
            for q, v in zip(levels, values.double().quantile(levels), strict=True)}


def _histogram(values: torch.Tensor, bins: int = 80) -> dict[str, list[float]]:
    """Counts over ``bins`` equal bins between the 0.5th and 99.5th percentiles (the tails are
    counted in the end bins)."""
    values = values.double()
    low, high = (float(v) for v in values.quantile(torch.tensor([0.005, 0.995],
                                                                dtype=torch.float64)))
    if high <= low:
        low, high = low - 0.5, high + 0.5
    counts = torch.histc(values.clamp(low, high), bins=bins, min=low, max=high)
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


@torch.no_grad()
def _statistics(model, blocks: torch.Tensor, batch_size: int) -> dict[str, Any]:
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    device = next(model.parameters()).device
    values = {name: [[] for _ in range(layers)] for name in (*_GEOMETRY, "slot_ess")}
    half_lives = [[] for _ in range(layers)]
    inertia = torch.zeros(layers, heads, dtype=torch.float64)
    strength = torch.zeros(layers, heads, dtype=torch.float64)
    for start in range(0, blocks.shape[0], batch_size):
        batch = blocks[start:start + batch_size].to(device)
        stats = model(input_ids=batch, use_cache=False, output_refinement_stats=True
                      ).refinement_stats
        for layer, s in enumerate(stats):
            for name in values:
                values[name][layer].append(getattr(s, name).float().cpu().flatten())
            half_lives[layer].append(s.slot_write_half_life.cpu().flatten())
            inertia[layer] += s.routing_inertia.double().sum(0).cpu()
            strength[layer] += s.relative_magnitude.double().mean(-1).sum(0).cpu()
    return {"values": {name: [torch.cat(v) for v in per_layer]
                       for name, per_layer in values.items()},
            "half_lives": [torch.cat(v) for v in half_lives],
            "inertia": inertia / blocks.shape[0], "strength": strength / blocks.shape[0]}


def run_asm_refinement(model, tokenizer, *, blocks: int = 128, samples: int = 200_000,
                       betas: Sequence[float] = DEFAULT_BETAS, seed: int = 0,
                       batch_size: int = 16) -> dict[str, Any]:
    """Geometry, interventions, beta sweep and section-5 statistics (see the module docstring).

    Raises:
        ValueError: the model has no refinement, or the corpus gives no block of its context.
    """
    from modeling.asm.corpus_asm import CORPUS_SOURCE, kjv_corpus, pack_blocks

    config = model.config
    if not config.use_slot_space_refinement:
        raise ValueError("asm-refinement needs a model with use_slot_space_refinement=True")
    if not betas:
        raise ValueError("asm-refinement needs at least one beta")
    context = config.max_position_embeddings
    data = pack_blocks(kjv_corpus()["validation"]["text"], tokenizer, context)[:blocks]
    stats = _statistics(model, data, batch_size)
    generator = torch.Generator().manual_seed(seed)
    geometry: dict[str, Any] = {}
    for name in _GEOMETRY:
        per_layer = stats["values"][name]
        pooled = torch.cat(per_layer)
        pooled = pooled[torch.isfinite(pooled)]
        sample = pooled[torch.randperm(pooled.numel(), generator=generator)[:samples]]
        geometry[name] = {"median": float(sample.median()), "samples": int(sample.numel()),
                          "quantiles": _quantiles(sample), "histogram": _histogram(sample),
                          "median_per_layer": [float(v.median()) for v in per_layer],
                          "fraction_negative": float((sample < 0).float().mean())}
    layers = config.num_hidden_layers
    nll: dict[str, Any] = {"default": _nll(model, data, batch_size)}
    for mode in ("parallel_only", "orthogonal_only", "none"):
        with model.refinement_intervention(mode):
            nll[mode] = _nll(model, data, batch_size)
    per_layer = {mode: [] for mode in ("parallel_only", "orthogonal_only")}
    for mode, row in per_layer.items():
        for layer in range(layers):
            with model.refinement_intervention(mode, layers=[layer]):
                row.append(_nll(model, data, batch_size))
    sweep = []
    for beta in betas:
        with model.refinement_intervention("orthogonal_scaled", beta=float(beta)):
            sweep.append({"beta": float(beta), "nll": _nll(model, data, batch_size)})
    base = nll["default"]
    best = min(sweep, key=lambda entry: entry["nll"])
    zero = next((entry["nll"] for entry in sweep if entry["beta"] == 0.0), None)
    small = [entry["nll"] for entry in sweep if 0.0 < entry["beta"] <= 1.0]
    inertia, strength = stats["inertia"].flatten(), stats["strength"].flatten()
    half = [v.double() for v in stats["half_lives"]]
    ess = [float(v.mean()) for v in stats["values"]["slot_ess"]]
    orthogonal_by_layer = per_layer["orthogonal_only"]
    return {
        "corpus": f"{CORPUS_SOURCE}: validation chapters",
        "blocks": int(data.shape[0]), "context": context, "tokens": int(data[:, 1:].numel()),
        "geometry": geometry,
        "interventions": {
            "nll": nll, "delta": {mode: value - base for mode, value in nll.items()},
            "per_layer": per_layer,
            "per_layer_delta": {mode: [v - base for v in row] for mode, row in per_layer.items()}},
        "beta_sweep": {"points": sweep, "best_beta": best["beta"], "best_nll": best["nll"]},
        "slots": {
            "half_life_median_per_layer": [float(v.median()) for v in half],
            "half_life_p90_per_layer": [float(v.quantile(0.9)) for v in half],
            "half_life_histogram": _histogram(torch.cat(half), bins=min(40, context)),
            "ess_per_layer": ess,
            "num_slots": config.num_slots},
        "heads": {"routing_inertia": stats["inertia"].tolist(),
                  "refinement_strength": stats["strength"].tolist(),
                  "pearson": _pearson(inertia, strength),
                  "spearman": _spearman(inertia, strength)},
        "claims": {
            "alpha_median_negative": geometry["alpha"]["median"] < 0,
            "orthogonal_fraction_median_below_half":
                geometry["orthogonal_fraction"]["median"] < 0.5,
            "orthogonal_only_worse_than_parallel_only":
                nll["orthogonal_only"] > nll["parallel_only"],
            "small_beta_at_least_as_good_as_zero":
                zero is not None and bool(small) and min(small) <= zero,
            "orthogonal_only_hurts_layer_0_most":
                max(orthogonal_by_layer) == orthogonal_by_layer[0],
            "ess_u_shaped": layers >= 3 and min(ess[1:-1]) < min(ess[0], ess[-1]),
            "inertia_strength_correlation_negative": _pearson(inertia, strength) < 0},
    }
