"""The one dispatcher of the ASM kernels: which form runs.

The model resolves ``config.scan_backend`` once per forward pass (:func:`resolve_backend`) and
hands the resolved form to every layer.

``backend`` (``config.scan_backend``): ``"torch"`` (the chunk form with hand-written backwards,
:mod:`.asm_chunk`), ``"triton"`` (the fused recurrent Triton kernels,
:mod:`.asm_fused_recurrent`), ``"triton_chunk"`` (the chunk-parallel Triton kernels,
:mod:`.asm_triton_chunk`; with either Triton form the slot addressing runs as one fused kernel,
:mod:`.asm_triton_addressing`) — the Triton forms on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` — or ``"auto"``: on CUDA with Triton installed, the chunk kernels for
passes of at least :data:`CHUNK_FROM` positions (training, prefill) and the recurrent ones below
(decoding); else PyTorch. (The interpreter is for testing kernels, so ``auto`` never picks it.
The threshold is a guess: on an H200 the chunk kernels ran 2-6x the recurrent ones from 1,024
positions, shorter passes were not measured; ``benchmarks/gpu/asm.py``.)
"""

from __future__ import annotations

import os

import torch

from .asm_addressing import slot_addressing_torch
from .asm_chunk import asa_attend_chunk, causal_linear_attention_chunk
from .asm_common import Refine, ScanState
from .asm_fused_recurrent import (
    asa_attend_fused_recurrent,
    causal_linear_attention_fused_recurrent,
    triton,
)
from .asm_triton_addressing import slot_addressing_triton
from .asm_triton_chunk import asa_attend_triton_chunk, causal_linear_attention_triton_chunk
from .configuration_asm import SCAN_BACKENDS

__all__ = ["CHUNK_FROM", "asa_attend", "causal_linear_attention", "resolve_backend",
           "slot_addressing"]

CHUNK_FROM = 32  # positions per pass from which "auto" takes the chunk kernels on CUDA


def resolve_backend(backend: str, like: torch.Tensor, length: int) -> str:
    """The form a ``scan_backend`` value runs on tensors like ``like`` for a pass of ``length``
    positions: ``"torch"``, ``"triton"`` or ``"triton_chunk"`` (a resolved value resolves to
    itself)."""
    if backend not in SCAN_BACKENDS:
        raise ValueError(f"backend must be one of {SCAN_BACKENDS}, got {backend!r}")
    if backend.startswith("triton"):
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if triton is None or not (like.is_cuda or interpreted):
            raise RuntimeError(f"backend {backend!r} needs the triton package and a CUDA tensor "
                               "(or TRITON_INTERPRET=1 set before the kernels are imported)")
        return backend
    if backend == "auto" and triton is not None and like.is_cuda:
        return "triton_chunk" if length >= CHUNK_FROM else "triton"
    return "torch"


def asa_attend(
    logits: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    key_logits: torch.Tensor,
    gamma: torch.Tensor | float,
    read_temperature: float = 1.0,
    refine: Refine | None = None,
    chunk_size: int = 64,
    state: ScanState | None = None,
    backend: str = "auto",
    gate: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ScanState]:
    """The scan + read (arguments and results as in
    :func:`~.asm_chunk_autograd.asa_attend_chunk_autograd`) by the form ``backend`` picks (see
    the module docstring)."""
    form = resolve_backend(backend, v, v.shape[2])
    if form == "triton":
        return asa_attend_fused_recurrent(logits, v, q, key_logits, gamma, read_temperature,
                                          refine, state, gate)
    if form == "triton_chunk":
        return asa_attend_triton_chunk(logits, v, q, key_logits, gamma, read_temperature,
                                       refine, state, gate)
    return asa_attend_chunk(logits, v, q, key_logits, gamma, read_temperature, refine,
                            chunk_size, state, gate)


def causal_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    chunk_size: int = 64,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Dispatcher for the causal linear attention (``backend`` as in :func:`asa_attend`)."""
    form = resolve_backend(backend, v, v.shape[2])
    if form == "triton":
        return causal_linear_attention_fused_recurrent(phi_q, phi_k, v, state)
    if form == "triton_chunk":
        return causal_linear_attention_triton_chunk(phi_q, phi_k, v, state)
    return causal_linear_attention_chunk(phi_q, phi_k, v, chunk_size, state)


def slot_addressing(
    key: torch.Tensor,
    q: torch.Tensor,
    slot_keys: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    positions: torch.Tensor,
    valid: torch.Tensor,
    recency: torch.Tensor | None,
    write_scale: float,
    read_scale: float,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The write and read logits (arguments and results as in
    :func:`~.asm_addressing.slot_addressing_torch`) by the form ``backend`` picks: the fused
    Triton kernel (:mod:`.asm_triton_addressing`, one launch each way) wherever the scan runs
    on Triton, else the PyTorch form."""
    if resolve_backend(backend, key, key.shape[2]) != "torch":
        return slot_addressing_triton(key, q, slot_keys, rotary, positions, valid, recency,
                                      write_scale, read_scale)
    return slot_addressing_torch(key, q, slot_keys, rotary, positions, valid, recency,
                                 write_scale, read_scale)
