"""The whole analysis in one call: corpus pass, value projections, per-layer results as JSON.

``analyze_ffn_memories`` returns a JSON-ready dict (lists indexed like ``layers``) and, as a
second value, the ``CorpusPass`` and per-layer ``ValueAgreement`` objects for further study.
``shallow_trigger_share`` is our automatic stand-in for the paper's human annotation (figure 2):
the share of a memory's top-k trigger prefixes whose last token ends at least 3 of them (the
paper's "shared last word" pattern, a shallow pattern with its 3-prefix minimum).
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .composition import CASES, classify, zero_agreement
from .corpus import TokenizedCorpus
from .corpus_pass import CorpusPass, run_corpus_pass
from .mlp_adapter import ffn_adapter
from .values import ValueAgreement, project_values_signed, value_agreement

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["analyze_ffn_memories", "shallow_trigger_share"]

SIGNS = {"+": 1, "-": -1}  # a trigger polarity's sign of the coefficient
SHALLOW_MIN_COUNT = 3


def shallow_trigger_share(last_tokens: torch.Tensor, min_count: int = SHALLOW_MIN_COUNT
                          ) -> torch.Tensor:
    """``[M, k]`` last tokens of each memory's triggers -> ``[M]`` share in a shared-last-token
    group of at least ``min_count`` triggers."""
    counts = (last_tokens[:, :, None] == last_tokens[:, None, :]).sum(-1)
    return (counts >= min_count).float().mean(1)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "hf-memory"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def _examples(tokenizer: PreTrainedTokenizerBase, corpus: TokenizedCorpus,
              passed: CorpusPass, agreement: ValueAgreement, li: int, count: int = 3
              ) -> list[dict[str, Any]]:
    """A few agreeing memories of one layer (+ polarity): value token and top-3 triggers."""
    out = []
    prefixes = passed.triggers["+"].prefixes[li]
    for memory in agreement.agree_top1.nonzero().flatten()[:count].tolist():
        triggers = [corpus.prefix_text(tokenizer, int(p)) for p in prefixes[memory, :3]]
        out.append({
            "memory": memory,
            "value_top_token": tokenizer.decode([int(agreement.top_token[memory])]),
            "triggers": [{"prefix": text, "next": nxt} for text, nxt in triggers],
        })
    return out


def analyze_ffn_memories(
    model: torch.nn.Module,
    corpus: TokenizedCorpus,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    layers: list[int] | None = None,
    top_k: int = 25,
    sample_size: int = 4000,
    active_threshold: float | None = None,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> tuple[dict[str, Any], CorpusPass, list[dict[str, ValueAgreement]]]:
    """Run every analysis of the paper that needs no human annotator on ``model``.

    Returns ``(results, corpus_pass, agreements)``; ``agreements[li][polarity]``.

    Raises:
        ValueError: see ``run_corpus_pass`` (bad layer, unsupported MLP, bad sizes).
    """
    start = time.perf_counter()
    adapter = ffn_adapter(model)
    passed = run_corpus_pass(
        model, corpus, adapter=adapter, layers=layers, top_k=top_k, sample_size=sample_size,
        active_threshold=active_threshold, batch_size=batch_size, seed=seed, progress=progress)
    targets_of, last_of = corpus.prefix_targets, corpus.prefix_last_tokens
    agreements: list[dict[str, ValueAgreement]] = []
    rates: dict[str, dict[str, list[float]]] = {
        p: {key: [] for key in ("top1", "any", "baseline_top1", "baseline_any",
                                "median_target_rank")}
        for p in passed.triggers}
    shallow, zero, refine, examples = [], [], [], {}
    cases: dict[str, list[float]] = {name: [] for name in CASES}
    for li, layer in enumerate(tqdm(passed.layers, desc="value projections", unit="layer",
                                    disable=not progress)):
        per_polarity = {}
        targets = {p: targets_of[index.prefixes[li]] for p, index in passed.triggers.items()}
        projected = project_values_signed(adapter, layer, {
            SIGNS[p]: wanted[:, :1] for p, wanted in targets.items()})
        for p, wanted in targets.items():
            agreement = value_agreement(adapter, layer, p, wanted, seed, projected[SIGNS[p]])
            per_polarity[p] = agreement
            rates[p]["top1"].append(agreement.agree_top1.float().mean().item())
            rates[p]["any"].append(agreement.agree_any.float().mean().item())
            rates[p]["baseline_top1"].append(agreement.baseline_top1.float().mean().item())
            rates[p]["baseline_any"].append(agreement.baseline_any.float().mean().item())
            rates[p]["median_target_rank"].append(agreement.target_rank.float().median().item())
        agreements.append(per_polarity)
        shallow.append(shallow_trigger_share(
            last_of[passed.triggers["+"].prefixes[li]]).mean().item())
        plus = per_polarity["+"].top_token
        minus = per_polarity["-"].top_token if "-" in per_polarity else plus
        zero.append(zero_agreement(passed.top_ffn[li], passed.active_sign[li], plus, minus)
                    .float().mean().item())
        case = classify(passed.top_residual[li], passed.top_ffn[li], passed.top_output[li])
        for ci, name in enumerate(CASES):
            cases[name].append((case == ci).float().mean().item())
        refine.append((passed.top_residual[li] == passed.final_top).float().mean().item())
        if tokenizer is not None:
            examples[str(layer)] = _examples(tokenizer, corpus, passed, per_polarity["+"], li)

    config = model.config
    results = {
        "model": {
            "name": getattr(config, "name_or_path", "") or type(model).__name__,
            "model_type": getattr(config, "model_type", None),
            "num_layers": len(adapter.layers),
            "mlp_kind": adapter.kind,
            "memories_per_layer": adapter.num_memories,
            "vocab_size": adapter.unembedding.out_features,
        },
        "corpus": {
            "sentences": len(corpus.token_ids),
            "prefixes": corpus.num_prefixes,
            "tokens": sum(len(ids) for ids in corpus.token_ids),
        },
        "config": {
            "layers": list(passed.layers), "top_k": top_k, "sample_size": len(passed.sample),
            "active_threshold": passed.active_threshold, "batch_size": batch_size, "seed": seed,
        },
        "definitions": {
            "coefficient": ("gated: m_i = act(gate_i.x)*(up_i.x), the input of down_proj; "
                            "relu: m_i = relu(k_i.x)"),
            "value": "column i of the output projection, read through final norm + unembedding",
            "polarity": "'+' ranks triggers by m_i with value +v_i; '-' by -m_i with -v_i",
            "active": "|m_i| > active_threshold * max_j |m_j| at the prefix",
            "prefix": "the prefix ending at token t predicts token t+1",
        },
        "layers": list(passed.layers),
        "agreement": rates,
        "shallow_trigger_share": shallow,
        "active_fraction": passed.active_fraction.tolist(),
        "zero_agreement_rate": zero,
        "cases": cases,
        "residual_matches_final": refine,
        "examples": examples,
        "versions": _versions(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    return results, passed, agreements
