"""The one mixture dispatcher (``hf_memory.steering.dispatch``) makes the choice the four decision
points it replaced made (``attention._by_lse``, ``attention._merge_for``, and the kernel checks
``lse_kernel_available`` / ``fused_merge_applies`` they called), for every combination of their
inputs; each form's numbers against the reference are the exactness tests'
(``test_steering_lse_path.py``, ``test_fused_merge.py``, ``test_properties_cores.py``)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hf_memory.steering import dispatch, fused_merge, mixture
from hf_memory.steering.dispatch import (
    FUSED,
    LSE,
    MIXTURE_FORMS,
    PAGED,
    REFERENCE,
    MixtureInputs,
    choose_form,
    implementation,
    resolve_form,
)

SCORE_KWARGS = [{}, {"softcap": 30.0}, {"s_aux": 0.0}, {"sinks": 0.0}, {"position_bias": 0.0}]


def old_choice(path, base, dropout, record_routing, trace_only, kwargs, lse_kernel, is_cuda,
               compiling, fused_applies):
    """The choice as ``attention._by_lse`` and ``attention._merge_for`` made it (before the
    dispatcher), with the two kernel checks' answers given."""
    by_lse = (path in ("auto", "torch") and base == "sdpa" and not dropout
              and not record_routing and not trace_only
              and not any(kwargs.get(name) is not None
                          for name in ("softcap", "s_aux", "sinks", "position_bias"))
              and lse_kernel)
    if not by_lse:
        return REFERENCE
    if path == "auto" and is_cuda and not compiling and fused_applies:
        return FUSED
    return LSE


CASES = list(itertools.product(("auto", "torch", "reference"), ("sdpa", "eager"), (0.0, 0.1),
                               (False, True), (False, True), range(len(SCORE_KWARGS)),
                               (False, True), (False, True), (False, True), (False, True)))


def test_every_combination_is_the_old_choice(monkeypatch):
    """``resolve_form`` over every combination of its inputs (the two kernel checks and the
    tracing flag stubbed) gives what the old code gave."""
    state = {}
    monkeypatch.setattr(dispatch, "lse_kernel_available", lambda query: state["lse"])
    monkeypatch.setattr(fused_merge, "fused_merge_applies",
                        lambda query, slots: state["fused"])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: state["compiling"])
    for (path, base, dropout, routing, trace, k, lse, cuda, compiling, fused) in CASES:
        state.update(lse=lse, fused=fused, compiling=compiling)
        got = resolve_form(path=path, base=base, dropout=dropout,
                           history_scores=routing or trace, kwargs=SCORE_KWARGS[k],
                           query=SimpleNamespace(is_cuda=cuda), slots=None)
        want = old_choice(path, base, dropout, routing, trace, SCORE_KWARGS[k], lse, cuda,
                          compiling, fused)
        assert got == want, (path, base, dropout, routing, trace, SCORE_KWARGS[k], lse, cuda,
                             compiling, fused)


def test_the_vllm_host_always_runs_the_paged_form():
    """The vLLM worker ran ``bank_mixture_over`` whatever else held."""
    for path, base, lse, fused in itertools.product(("auto", "torch", "reference"),
                                                    ("sdpa", "eager"), (False, True),
                                                    (False, True)):
        inputs = MixtureInputs(host="vllm", path=path, base=base, lse_kernel=lse,
                               fused_kernel=fused)
        assert choose_form(inputs) == PAGED
    from hf_memory_vllm import worker

    assert worker.MIXTURE is mixture.bank_mixture_over


def test_each_form_names_its_function():
    assert implementation(REFERENCE) is mixture.bank_mixture
    assert implementation(LSE) is mixture.bank_mixture_by_lse
    assert implementation(FUSED) is fused_merge.fused_bank_mixture_by_lse
    assert implementation(PAGED) is mixture.bank_mixture_over
    assert set(MIXTURE_FORMS) == {REFERENCE, LSE, FUSED, PAGED}
    with pytest.raises(ValueError, match="form must be one of"):
        implementation("fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_real_cpu_queries(dtype):
    """On the CPU: the log-sum-exp form under ``auto`` and ``torch`` (never the fused one),
    the reference where asked for or where the scores are needed."""
    query = torch.zeros(1, 2, 3, 8, dtype=dtype)
    common = dict(base="sdpa", dropout=0.0, kwargs={}, query=query, slots=None)
    assert resolve_form(path="auto", history_scores=False, **common) == LSE
    assert resolve_form(path="torch", history_scores=False, **common) == LSE
    assert resolve_form(path="reference", history_scores=False, **common) == REFERENCE
    assert resolve_form(path="auto", history_scores=True, **common) == REFERENCE


def test_a_cpu_process_never_imports_the_fused_merge():
    """Steering on the CPU resolves its form without importing the Triton merge's module."""
    code = ("import sys, torch\n"
            "from hf_memory.steering.dispatch import resolve_form\n"
            "q = torch.zeros(1, 2, 3, 8)\n"
            "for path in ('auto', 'torch', 'reference'):\n"
            "    resolve_form(path=path, base='sdpa', dropout=0.0, history_scores=False,\n"
            "                 kwargs={}, query=q, slots=None)\n"
            "assert 'hf_memory.steering.fused_merge' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
