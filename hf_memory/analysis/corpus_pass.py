"""One forward pass over the corpus that gathers everything the analyses need.

Per analysed layer, over every predicting prefix of the corpus (see ``corpus``):

- trigger examples: the top-k prefixes by coefficient, streamed (``StreamingTopK``), never the
  full ``[P, M]`` matrix. Polarity ``+`` ranks by ``m_i`` (largest first: the prefixes that write
  ``+v_i`` hardest); for signed (gated) MLPs polarity ``-`` ranks by ``-m_i`` (prefixes that write
  ``-v_i`` hardest). Ties go to the smaller prefix id.
- the active-memory fraction: memory i is active at a prefix when
  ``|m_i| > threshold · max_j |m_j|`` (sign-blind). Threshold 0 is the paper's ``m_i > 0`` for
  ReLU; it is the default for ReLU MLPs, 0.1 the default for gated ones, whose SiLU coefficients
  are almost never exactly zero.

On a seeded sample of prefixes (the paper uses 4,000), per layer: ``top(r)``, ``top(y)``,
``top(o)`` through the logit lens, the model's final prediction, and the active memories with
their sign (for the zero-agreement rate, which needs the value projections computed later).

Sentences are batched by length with right padding, so padded positions never influence the
predicting prefixes under the causal mask. The base model (``model.model``) is run, so full
logits are never computed; the final prediction is read from the final-norm output at the
sampled prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .capture import capture_ffn
from .corpus import TokenizedCorpus
from .logit_lens import top_tokens
from .mlp_adapter import FFNAdapter, ffn_adapter
from .streaming_topk import StreamingTopK

__all__ = ["DEFAULT_ACTIVE_THRESHOLD", "CorpusPass", "TriggerIndex", "run_corpus_pass"]

DEFAULT_ACTIVE_THRESHOLD = {"relu": 0.0, "gated": 0.1}


@dataclass(frozen=True)
class TriggerIndex:
    """Top-k trigger prefixes of one polarity: ``[L, M, k]`` each, best first.

    ``scores`` are ``m_i`` for polarity ``+`` and ``-m_i`` for polarity ``-``.
    """

    polarity: str
    scores: torch.Tensor
    prefixes: torch.Tensor


@dataclass(frozen=True)
class CorpusPass:
    """What one pass over the corpus gathered. ``L`` = len(layers), ``n`` = sampled prefixes."""

    kind: str
    layers: tuple[int, ...]
    top_k: int
    active_threshold: float
    triggers: dict[str, TriggerIndex]
    active_fraction: torch.Tensor  # [L] mean share of active memories over all prefixes
    num_prefixes: int
    sample: torch.Tensor  # [n] prefix ids, ascending
    top_residual: torch.Tensor  # [L, n]
    top_ffn: torch.Tensor  # [L, n]
    top_output: torch.Tensor  # [L, n]
    final_top: torch.Tensor  # [n] the model's own top prediction
    active_sign: torch.Tensor  # [L, n, M] int8: sign(m_i) where active, else 0


def _active(m: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[N, M]`` bool: ``|m_i| > threshold · max_j |m_j|`` per row."""
    magnitude = m.abs()
    return magnitude > threshold * magnitude.amax(dim=1, keepdim=True)


@torch.no_grad()
def run_corpus_pass(
    model: torch.nn.Module,
    corpus: TokenizedCorpus,
    *,
    adapter: FFNAdapter | None = None,
    layers: list[int] | None = None,
    top_k: int = 25,
    sample_size: int = 4000,
    active_threshold: float | None = None,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> CorpusPass:
    """Run the model over ``corpus`` once and gather triggers, activity and lens tops.

    Raises:
        ValueError: unknown layer, unsupported MLP, ``top_k`` / ``sample_size`` /
            ``batch_size`` < 1, or a negative threshold.
    """
    adapter = adapter or ffn_adapter(model)
    layers = adapter.check_layers(layers)
    for name, value in (("top_k", top_k), ("sample_size", sample_size),
                        ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    threshold = (DEFAULT_ACTIVE_THRESHOLD[adapter.kind] if active_threshold is None
                 else float(active_threshold))
    if threshold < 0:
        raise ValueError(f"active_threshold must be >= 0, got {threshold}")
    device = next(model.parameters()).device
    memories = adapter.num_memories
    polarities = ("+", "-") if adapter.signed else ("+",)
    streams = {(p, layer): StreamingTopK(memories, top_k) for p in polarities for layer in layers}
    active_sum = torch.zeros(len(layers), dtype=torch.float64)

    generator = torch.Generator().manual_seed(seed)
    total = corpus.num_prefixes
    sample = torch.randperm(total, generator=generator)[: min(sample_size, total)].sort().values
    in_sample = torch.zeros(total, dtype=torch.bool)
    in_sample[sample] = True
    got_ids, got = [], {name: [] for name in ("r", "y", "o", "final", "sign")}

    lengths = [len(ids) for ids in corpus.token_ids]
    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    bar = tqdm(total=len(order), desc="corpus pass", unit="sent", disable=not progress)
    for start in range(0, len(order), batch_size):
        batch = order[start: start + batch_size]
        width = lengths[batch[0]]
        input_ids = torch.zeros(len(batch), width, dtype=torch.int64)
        attention = torch.zeros(len(batch), width, dtype=torch.int64)
        predicting = torch.zeros(len(batch), width, dtype=torch.bool)
        prefix_ids = torch.zeros(len(batch), width, dtype=torch.int64)
        for row, s in enumerate(batch):
            n = lengths[s]
            input_ids[row, :n] = torch.tensor(corpus.token_ids[s])
            attention[row, :n] = 1
            predicting[row, : n - 1] = True
            prefix_ids[row, : n - 1] = corpus.prefix_offsets[s] + torch.arange(n - 1)
        with capture_ffn(adapter, layers) as record:
            # The base model: logits are needed only at sampled prefixes (from record.final).
            model.model(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                        use_cache=False)
        pids = prefix_ids[predicting]
        chosen = in_sample[pids]
        got_ids.append(pids[chosen])
        chosen_dev = chosen.to(device)
        mask = predicting.to(device)
        signs = []
        for li, layer in enumerate(layers):
            m = record.coefficients[layer][mask].float()
            streams["+", layer].update(m.cpu(), pids)
            if adapter.signed:
                streams["-", layer].update((-m).cpu(), pids)
            active = _active(m, threshold)
            active_sum[li] += active.double().mean(dim=1).sum().cpu()
            signs.append((torch.sign(m[chosen_dev]) * active[chosen_dev]).to(torch.int8).cpu())
            r = record.residual[layer][mask][chosen_dev]
            y = record.ffn_output[layer][mask][chosen_dev]
            got["r"].append(top_tokens(adapter, r).cpu())
            got["y"].append(top_tokens(adapter, y).cpu())
            got["o"].append(top_tokens(adapter, r + y).cpu())
        got["sign"].append(torch.stack(signs))
        final = record.final[mask][chosen_dev]
        got["final"].append(adapter.unembedding(final).argmax(-1).cpu())
        bar.update(len(batch))
    bar.close()

    ids = torch.cat(got_ids)
    arrange = ids.argsort()

    def stacked(name: str) -> torch.Tensor:
        per_layer = torch.cat(
            [torch.stack(got[name][b * len(layers): (b + 1) * len(layers)])
             for b in range(len(got_ids))], dim=1)
        return per_layer[:, arrange]

    triggers = {}
    for p in polarities:
        results = [streams[p, layer].result() for layer in layers]
        triggers[p] = TriggerIndex(p, torch.stack([v for v, _ in results]),
                                   torch.stack([i for _, i in results]))
    return CorpusPass(
        kind=adapter.kind,
        layers=tuple(layers),
        top_k=top_k,
        active_threshold=threshold,
        triggers=triggers,
        active_fraction=(active_sum / total).float(),
        num_prefixes=total,
        sample=ids[arrange],
        top_residual=stacked("r"),
        top_ffn=stacked("y"),
        top_output=stacked("o"),
        final_top=torch.cat(got["final"])[arrange],
        active_sign=torch.cat(got["sign"], dim=1)[:, arrange],
    )
