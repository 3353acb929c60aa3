"""Value vectors read as next-token distributions, and their agreement with the triggers.

Value ``v_i`` of polarity ``s`` (+1 or -1; the sign of the coefficient that writes it) is read
through the logit lens: ``p_i = softmax(lens(s · v_i))``, i.e. the final-norm gain is applied (see
``logit_lens``). Its top token is ``top(s · v_i)``.

Agreement (section 4), per layer and polarity, over the memories:

- ``agreement_top1``: the value's top token is the target (next token) of its top-1 trigger
  prefix (the paper's definition);
- ``agreement_any``: it is the target of at least one of its top-k trigger prefixes;
- the ``baseline_*`` rates use the targets of a random other memory of the same layer (a seeded
  permutation), which keeps the token frequencies of real targets.

``target_rank``: rank (0 = top) of the top-1 trigger's target in the value's distribution
(figure 5; only the top-1 trigger, since each rank costs a pass over the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logit_lens import logit_lens
from .mlp_adapter import FFNAdapter

__all__ = ["ValueAgreement", "project_values", "project_values_signed",
           "value_agreement"]


@torch.no_grad()
def project_values(adapter: FFNAdapter, layer: int, sign: int = 1,
                   targets: torch.Tensor | None = None, chunk: int = 64
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top token of every value of ``layer`` with polarity ``sign``, and target ranks.

    targets: optional ``[M, k]`` token ids. Returns ``(top [M], rank [M, k] or None)``; rank is
    the number of tokens with a strictly larger logit.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign}")
    return project_values_signed(adapter, layer, {sign: targets}, chunk)[sign]


def _ranks(logits: torch.Tensor, wanted: torch.Tensor, larger: bool) -> torch.Tensor:
    """``[c, k]``: per row, how many logits are strictly larger (``larger``) or smaller than
    each wanted logit."""
    return torch.stack([(logits > w if larger else logits < w).sum(-1)
                        for w in wanted.split(1, dim=1)], dim=1).cpu()


@torch.no_grad()
def project_values_signed(adapter: FFNAdapter, layer: int,
                          targets: dict[int, torch.Tensor | None], chunk: int = 64
                          ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`project_values` for each sign in ``targets`` (``{+1 or -1: [M, k] ids or None}``).

    Where the lens is odd (``lens(-v) = -lens(v)``: an RMSNorm or bias-free norm and a bias-free
    unembedding, checked exactly on the first chunk), both signs are read off one
    projection of ``+v``: the top token of ``-v`` is the argmin of ``lens(v)`` and its ranks
    count the smaller logits, the same numbers as projecting ``-v``, at half the cost."""
    if not targets or any(sign not in (1, -1) for sign in targets):
        raise ValueError(f"signs must be +1 or -1, got {sorted(targets)}")
    (layer,) = adapter.check_layers([layer])
    values = adapter.layers[layer].values  # [M, d]
    out: dict[int, tuple[list, list]] = {sign: ([], []) for sign in targets}
    shared = None  # decided on the first chunk, where both signs are projected
    for start in range(0, values.shape[0], chunk):
        rows = values[start: start + chunk]
        plus = logit_lens(adapter, rows).float() if 1 in targets else None  # [c, V]
        minus = None
        if -1 in targets and not shared:
            minus = logit_lens(adapter, -rows).float()
            if shared is None:
                shared = plus is not None and torch.equal(minus, -plus)
        for sign, wanted_ids in targets.items():
            if sign == 1 or minus is not None:
                signed = plus if sign == 1 else minus
                top, larger = signed.argmax(-1), True
            else:  # ``-lens(v)`` in place of ``lens(-v)``: equal, so argmax becomes argmin
                signed, top, larger = plus, plus.argmin(-1), False
            out[sign][0].append(top.cpu())
            if wanted_ids is not None:
                wanted = signed.gather(1, wanted_ids[start: start + chunk].to(signed.device))
                out[sign][1].append(_ranks(signed, wanted, larger))
    return {sign: (torch.cat(tops), torch.cat(ranks) if targets[sign] is not None else None)
            for sign, (tops, ranks) in out.items()}


@dataclass(frozen=True)
class ValueAgreement:
    """Section-4 statistics of one layer and polarity; ``[M]`` or ``[M, k]`` tensors."""

    layer: int
    polarity: str
    top_token: torch.Tensor  # [M]
    trigger_targets: torch.Tensor  # [M, k]
    target_rank: torch.Tensor  # [M] rank of the top-1 trigger's target
    agree_top1: torch.Tensor  # [M] bool
    agree_any: torch.Tensor  # [M] bool
    baseline_top1: torch.Tensor  # [M] bool
    baseline_any: torch.Tensor  # [M] bool


def value_agreement(adapter: FFNAdapter, layer: int, polarity: str,
                    trigger_targets: torch.Tensor, seed: int = 0,
                    projected: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> ValueAgreement:
    """Agreement of layer ``layer``'s values with their trigger targets ``[M, k]``;
    ``projected``: this polarity's ``(top, rank of the top-1 target)`` from
    :func:`project_values_signed`, computed here when None."""
    if polarity not in ("+", "-"):
        raise ValueError(f"polarity must be '+' or '-', got {polarity!r}")
    top, rank = projected if projected is not None else project_values(
        adapter, layer, 1 if polarity == "+" else -1, trigger_targets[:, :1])
    generator = torch.Generator().manual_seed(seed + layer)
    other = trigger_targets[torch.randperm(len(top), generator=generator)]
    return ValueAgreement(
        layer=layer,
        polarity=polarity,
        top_token=top,
        trigger_targets=trigger_targets,
        target_rank=rank[:, 0],
        agree_top1=top == trigger_targets[:, 0],
        agree_any=(top[:, None] == trigger_targets).any(1),
        baseline_top1=top == other[:, 0],
        baseline_any=(top[:, None] == other).any(1),
    )
