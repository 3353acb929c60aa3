"""Which form of the bank mixture runs at a steered site: one decision over four named forms.

Every form computes the same mixture (one softmax over [history ; bank slots]) up to rounding:

* :data:`REFERENCE` — the history's scores recomputed beside the stock call
  (:func:`~hf_memory.steering.mixture.bank_mixture`): the form every other is tested against;
* :data:`LSE` — the banks merged into the stock SDPA kernel's output through its log-sum-exp, in
  PyTorch ops (:func:`~hf_memory.steering.mixture.bank_mixture_by_lse`, the history from
  :func:`~hf_memory.steering.stock_attention.attention_with_lse`);
* :data:`FUSED` — the same merge in one Triton kernel on CUDA
  (:func:`~hf_memory.steering.fused_merge.fused_bank_mixture_by_lse`);
* :data:`PAGED` — vLLM's own attention output over a paged history merged with the slot logits
  (:func:`~hf_memory.steering.mixture.bank_mixture_over`, the vLLM worker's form).

:func:`choose_form` is the decision on explicit inputs (:class:`MixtureInputs`);
:func:`resolve_form` gathers those inputs from a call's tensors (Triton imported only where it
could change the choice: a CPU process never loads it); :func:`implementation` is the function
of a form. ``steer(mixture_path=...)`` asks for one of :data:`MIXTURE_PATHS`: ``"auto"`` (the
fastest form that applies), ``"torch"`` (never :data:`FUSED`), ``"reference"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from hf_memory.steering import mixture
from hf_memory.steering.stock_attention import lse_kernel_available

__all__ = ["FUSED", "LSE", "MIXTURE_FORMS", "MIXTURE_PATHS", "PAGED", "REFERENCE",
           "MixtureInputs", "choose_form", "implementation", "resolve_form"]

REFERENCE, LSE, FUSED, PAGED = "reference", "lse", "fused", "paged"
MIXTURE_FORMS = (REFERENCE, LSE, FUSED, PAGED)
MIXTURE_PATHS = ("auto", "torch", "reference")  # what steer(mixture_path=...) may ask for
# attention keywords that change the history's scores (no log-sum-exp kernel takes them)
SCORE_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


@dataclass(frozen=True)
class MixtureInputs:
    """What decides the form at one steered site for one call.

    Attributes:
        host: ``"transformers"`` (``steer()``) or ``"vllm"`` (the worker plugin).
        path: the steering's ``mixture_path`` (:data:`MIXTURE_PATHS`).
        base: the stock attention the steered one wraps (``"sdpa"`` or ``"eager"``).
        dropout: attention dropout is on.
        history_scores: the history's scores themselves are needed (routing recorded, or a
            trace-only steering).
        score_kwargs: the call passes a soft-cap, sinks or a position bias (:data:`SCORE_KWARGS`).
        lse_kernel: a stock kernel returns the log-sum-exp for the query's device and dtype
            (:func:`~hf_memory.steering.stock_attention.lse_kernel_available`).
        fused_kernel: the Triton merge applies to the query and slots
            (:func:`~hf_memory.steering.fused_merge.fused_merge_applies`: CUDA, Triton, float32
            slots that fit its tile, not traced).
    """

    host: str = "transformers"
    path: str = "auto"
    base: str = "sdpa"
    dropout: bool = False
    history_scores: bool = False
    score_kwargs: bool = False
    lse_kernel: bool = True
    fused_kernel: bool = False


def choose_form(inputs: MixtureInputs) -> str:
    """The form (:data:`MIXTURE_FORMS`) that runs for ``inputs``."""
    if inputs.host == "vllm":
        return PAGED
    if (inputs.path == "reference" or inputs.base != "sdpa" or inputs.dropout
            or inputs.history_scores or inputs.score_kwargs or not inputs.lse_kernel):
        return REFERENCE
    return FUSED if inputs.path == "auto" and inputs.fused_kernel else LSE


def resolve_form(*, path: str, base: str, dropout: float, history_scores: bool,
                 kwargs: Mapping[str, Any], query: torch.Tensor,
                 slots: mixture.HeadSlots | None) -> str:
    """The form of a transformers call: :func:`choose_form` on the inputs read off the call
    (``query`` ``[B, H, T, D]``, the site's per-head ``slots``, the attention ``kwargs``)."""
    inputs = MixtureInputs(
        path=path, base=base, dropout=bool(dropout), history_scores=history_scores,
        score_kwargs=any(kwargs.get(name) is not None for name in SCORE_KWARGS),
        lse_kernel=lse_kernel_available(query))
    form = choose_form(inputs)
    if form == LSE and path == "auto" and query.is_cuda and not torch.compiler.is_compiling():
        from hf_memory.steering.fused_merge import fused_merge_applies

        form = choose_form(replace(inputs, fused_kernel=fused_merge_applies(query, slots)))
    return form


def implementation(form: str) -> Callable[..., Any]:
    """The function computing ``form`` (looked up at call time, so Triton is imported only for
    :data:`FUSED`)."""
    if form == FUSED:
        from hf_memory.steering import fused_merge

        return fused_merge.fused_bank_mixture_by_lse
    functions = {REFERENCE: mixture.bank_mixture, LSE: mixture.bank_mixture_by_lse,
                 PAGED: mixture.bank_mixture_over}
    if form not in functions:
        raise ValueError(f"form must be one of {MIXTURE_FORMS}, got {form!r}")
    return functions[form]
