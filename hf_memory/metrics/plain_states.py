"""Steered passes that start where the steering starts: the plain model's lower layers, kept.

Memory steering at layers S changes nothing below min(S): the banks enter only the attention of
the steered layers, so the residual stream entering any layer ℓ ≤ min(S) is the plain model's,
bit for bit. A search that scores hundreds of configurations over the same rows (the cost
budget's neutral text, the calibration pairs) can keep the plain stream at the input of some
layers once, from the plain pass it makes anyway, and run each steered pass from the highest kept
layer at or below its lowest site: the same logits for (N − ℓ)/N of the work.

The stream is kept per row at its real positions (padding is masked out of every real position's
attention, so a batch assembled with zeros at the padded positions gives its real positions the
values a full pass gives them). The kept layers are every k-th, the smallest k that fits
``max_bytes``. Each is checked before its first use: on two rows of the first batch, a plain
pass from it must reproduce the full pass's logits exactly, else it is not used — a model whose
forward scales the input embeddings (Granite) gets full passes, never other logits. A forward
that reads each layer's type by its index in the list (Gemma 2 and 3) runs with the list's types
from the start.

Passes may run from several threads at once (a search's probe threads): a kept layer two of
them check at the same time is checked twice, to the same answer.

Which passes start higher is the attached context's to say: a memory-steering handle
(anything with ``active_sites``, the steered layers) starts at its lowest site; any other method
(CAA, a prompt, per-row banks) runs the whole model.
"""

from __future__ import annotations

import contextvars
import copy
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["DEFAULT_MAX_BYTES", "PlainStates", "left_padded"]

DEFAULT_MAX_BYTES = 512 * 2**20

Row = tuple[int, ...]


def _decoder(model: nn.Module) -> nn.Module | None:
    """The decoder stack under a ``*ForCausalLM`` (``model.model`` with ``layers``), or None."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return base if isinstance(layers, nn.ModuleList) and len(layers) > 1 else None


def _head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """What the causal-LM head makes of the decoder's output: the unembedding, then the
    families' logit scaling (Granite) and soft-cap (Gemma 2); checked against the full forward
    before any kept layer is used."""
    logits = model.get_output_embeddings()(hidden)
    scaling = getattr(model.config, "logits_scaling", None)
    if scaling:
        logits = logits / scaling
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


class PlainStates:
    """The plain residual stream entering the kept layers, per row (module docstring).

    Attributes:
        layers: the kept layers (empty: every pass runs the whole model); ``checked``: each
            layer checked so far, and whether it passed.
        reused: batches scored from a kept layer since recording.
    """

    def __init__(self, model: nn.Module, *, max_bytes: int | None = None) -> None:
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes  # read at the call
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.model, self.max_bytes = model, max_bytes
        self.layers: tuple[int, ...] = ()
        self.checked: dict[int, bool] = {}
        self.recorded = False
        self.reused = 0
        self._lock = threading.Lock()  # passes run from several threads (a search's probes)
        self._rows: dict[Row, dict[int, torch.Tensor]] = {}
        self._sample: tuple[Row, ...] = ()
        self._sample_logits: torch.Tensor | None = None

    def plan(self, rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """The layers worth keeping for ``rows``: every k-th from k, within ``max_bytes``."""
        base = _decoder(self.model)
        if base is None or not rows:
            return ()
        parameter = next(self.model.parameters())
        count = len(base.layers)
        per_layer = (sum(len(r) for r in rows) * self.model.config.hidden_size
                     * parameter.element_size())
        if per_layer > self.max_bytes:
            return ()
        stride = max(1, math.ceil(per_layer * (count - 1) / max(self.max_bytes, 1)))
        return tuple(range(stride, count, stride))

    def record(self, rows: Sequence[Row], hidden_states: Sequence[torch.Tensor],
               layers: Sequence[int]) -> None:
        """Keep ``hidden_states[ℓ]`` (the input of layer ℓ, from ``output_hidden_states``) of
        each row of one left-padded batch, at its real positions."""
        width = hidden_states[0].shape[1]
        for i, row in enumerate(rows):
            self._rows[tuple(row)] = {layer: hidden_states[layer][i, width - len(row):].clone()
                                      for layer in layers}
        if not self._sample:  # the check's rows: the first batch's shortest and longest
            self._sample = tuple(sorted({min(rows, key=len), max(rows, key=len)}))

    def finish(self, layers: Sequence[int]) -> None:
        """End the recording: ``layers`` are kept, each checked before its first use."""
        self.layers, self.recorded = tuple(layers), True

    def start(self, context: Any, rows: Sequence[Row]) -> int:
        """The layer a pass of ``rows`` under ``context`` (what the method attached) may start
        at: the highest kept layer at or below its lowest steered layer that passes its check;
        0: the whole model."""
        sites = getattr(context, "active_sites", None)
        if not self.layers or not isinstance(sites, dict) or not sites:
            return 0
        if not all(tuple(row) in self._rows for row in rows):
            return 0
        lowest = min(sites)
        for layer in sorted((k for k in self.layers if k <= lowest), reverse=True):
            if layer not in self.checked:
                self.checked[layer] = self._check(layer)
            if self.checked[layer]:
                return layer
        return 0

    def _check(self, layer: int) -> bool:
        """Whether a plain pass of the sample rows from ``layer`` gives the full pass's logits
        exactly (every real position of the shortest row's span). Run in an empty context:
        plain, whatever steering the caller's context holds."""
        return contextvars.Context().run(self._plain_check, layer)

    def _plain_check(self, layer: int) -> bool:
        keep = min(len(row) for row in self._sample)
        ids, mask, positions = left_padded(self._sample, 0,
                                           next(self.model.parameters()).device)
        if self._sample_logits is None:
            with torch.no_grad():
                self._sample_logits = self.model(input_ids=ids, attention_mask=mask,
                                                 position_ids=positions,
                                                 logits_to_keep=keep).logits
        try:
            logits = self._run(layer, self._sample, mask, positions, keep)
        except Exception:  # noqa: BLE001 - a forward that refuses the view: full passes
            return False
        return _same(logits, self._sample_logits)

    def logits(self, start: int, rows: Sequence[Row], mask: torch.Tensor,
               positions: torch.Tensor, keep: int) -> torch.Tensor:
        """The last ``keep`` positions' logits of a left-padded batch of ``rows``, run from
        layer ``start`` on the kept stream."""
        with self._lock:
            self.reused += 1
        return self._run(start, rows, mask, positions, keep)

    def _run(self, start: int, rows: Sequence[Row], mask: torch.Tensor, positions: torch.Tensor,
             keep: int) -> torch.Tensor:
        base = _decoder(self.model)
        width = mask.shape[1]
        first = self._rows[tuple(rows[0])][start]
        stream = first.new_zeros(len(rows), width, first.shape[-1])
        for i, row in enumerate(rows):
            stream[i, width - len(row):] = self._rows[tuple(row)][start]
        view = copy.copy(base)  # the same modules, the upper layers only: nothing shared changes
        view._modules = {**base._modules, "layers": base.layers[start:]}
        types = getattr(base.config, "layer_types", None)
        if isinstance(types, list | tuple):  # a forward that reads a layer's type by its index
            view.config = copy.copy(base.config)
            vars(view.config)["layer_types"] = list(types[start:])
        with torch.no_grad():
            hidden = view(inputs_embeds=stream, attention_mask=mask, position_ids=positions,
                          use_cache=False).last_hidden_state
            return _head_logits(self.model, hidden[:, -keep:])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN (a stock model's padded batch may score a position NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def left_padded(rows: Sequence[Row], pad: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` as one left-padded batch: ids (padded with ``pad``), mask, and positions
    counted from each row's first real token (as ``generate()`` counts them)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)
