"""A sequence's first token kept off the banks (``BankSet(..., sink_reads_banks=False)``).

The first token of a sequence is the model's attention sink: it attends to itself alone and
grows the massive activation that later tokens park their attention on. A visible system prompt
comes after it, so the sink never reads the prompt; banks placed before the conversation
(``placement="before"``) are visible to it by position, and when it reads them its activation
changes and with it every later token (measured in ``hf_memory/README.md``). At a site whose bank
set says so, every query that sees no key but its own keeps the stock attention output: the
stock function run on that query and its own key alone, which is what the stock call computes
for it (soft-caps, learned sinks and all). Decoding steps and later chunks of a prefill hold no
such query, so this costs nothing after the first forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from hf_memory.steering.mixture import visible_keys

__all__ = ["keep_sink_plain", "sink_queries"]


def sink_queries(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, queries)``: the batch rows and query indices whose query sees only its own key
    (the sequence's first token, after any left padding), or None when there is none."""
    if attention_mask is None and q_len == 1:  # one decoded token, or a one-token sequence
        if kv_len != 1:
            return None
        every = torch.arange(batch, device=device)
        return every, torch.zeros_like(every)
    visible = visible_keys(attention_mask, q_len, kv_len, device)[:, 0]  # [B|1, T, S]
    own = torch.arange(q_len, device=device) + (kv_len - q_len)
    alone = (visible.sum(-1) == 1) & visible[:, torch.arange(q_len, device=device), own]
    rows, queries = alone.expand(batch, q_len).nonzero(as_tuple=True)
    return (rows, queries) if len(rows) else None


@torch.compiler.disable  # data-dependent indices: outside any traced graph
def keep_sink_plain(output: torch.Tensor, groups: Sequence[torch.Tensor | None],
                    base: Callable, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, *, scaling: float,
                    **kwargs) -> None:
    """Write the stock output of every sink query of ``groups`` (batch rows; None: all) into
    ``output`` ``[B, T, H, D]`` in place."""
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    found = sink_queries(attention_mask, batch, q_len, kv_len, query.device)
    if found is None:
        return
    rows, queries = found
    if all(group is not None for group in groups):
        steered = torch.zeros(batch, dtype=torch.bool, device=query.device)
        for group in groups:
            steered[group] = True
        keep = steered[rows]
        rows, queries = rows[keep], queries[keep]
        if not len(rows):
            return
    keys = queries + (kv_len - q_len)
    lone, _ = base(module, query[rows, :, queries].unsqueeze(2),
                   key[rows, :, keys].unsqueeze(2), value[rows, :, keys].unsqueeze(2), None,
                   scaling=scaling, dropout=0.0, **kwargs)
    output[rows, queries] = lone[:, 0].to(output.dtype)
