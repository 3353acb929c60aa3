"""The one dispatcher of the ASM kernels: which form runs.

The model resolves ``config.scan_backend`` once per forward pass (:func:`resolve_backend`) and
hands the resolved form to every layer.

``backend`` (``config.scan_backend``): ``"torch"`` (the chunk form with hand-written backwards,
:mod:`.asm_chunk`), ``"triton"`` (the fused recurrent Triton kernels, :mod:`.asm_fused_recurrent`:
CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton on CUDA when installed, else
PyTorch; the interpreter is for testing kernels, so ``auto`` never picks it).
"""

from __future__ import annotations

import os

import torch

from .asm_chunk import asa_attend_chunk, causal_linear_attention_chunk
from .asm_common import Refine, ScanState
from .asm_fused_recurrent import (
    asa_attend_fused_recurrent,
    causal_linear_attention_fused_recurrent,
    triton,
)

__all__ = ["asa_attend", "causal_linear_attention", "resolve_backend"]


def resolve_backend(backend: str, like: torch.Tensor) -> str:
    """The form a ``scan_backend`` value (``"auto"``, ``"torch"``, ``"triton"``) runs on tensors
    like ``like``: ``"torch"`` or ``"triton"`` (a resolved value resolves to itself)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton":
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if triton is None or not (like.is_cuda or interpreted):
            raise RuntimeError("backend 'triton' needs the triton package and a CUDA tensor "
                               "(or TRITON_INTERPRET=1 set before the kernels are imported)")
        return "triton"
    return "triton" if backend == "auto" and triton is not None and like.is_cuda else "torch"


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
    if resolve_backend(backend, v) == "triton":
        return asa_attend_fused_recurrent(logits, v, q, key_logits, gamma, read_temperature,
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
    if resolve_backend(backend, v) == "triton":
        return causal_linear_attention_fused_recurrent(phi_q, phi_k, v, state)
    return causal_linear_attention_chunk(phi_q, phi_k, v, chunk_size, state)
