"""The ``hf-memory`` model type of lm-evaluation-harness: lm-eval's ``HFLM`` with our steering.

One steering per model object, chosen at construction (lm-eval's ``--model_args``):

- ``banks=DIR,selector=DIR``: memory inception (:func:`hf_memory.steer`) at the selector's sites;
- ``caa=DIR[,scale=x]``: CAA vectors (:func:`hf_memory.apply_caa`; a folder or a llama.cpp
  control-vector ``.gguf``) added at their site at every position (lm-eval has no instruction
  boundary), at their saved scale unless ``scale``;
- ``prompt=TEXT``: the text in the visible context — appended to the chat template's system
  message (:class:`hf_memory.baselines.methods.PromptMethod`'s ``"system"`` placement) when lm-eval
  applies
  the chat template, otherwise before every request's context (``TEXT\\n\\n``);
- nothing: the plain model, identical to lm-eval's ``hf``.

Under ``accelerate launch`` (``-m eval_harness.lm_eval_model``, ``pretrained`` a path) the
documents are split across the processes, on GPUs as lm-eval does and on CPUs too.

Banks, selectors and vectors are checked against the model's fingerprint when loaded. Steering
is held around each of lm-eval's forward calls (``_model_call``, ``_model_generate``), so
``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` keep lm-eval's own batching,
reordering and caching, and the steering travels with the call (per-call context, as everywhere
in ``hf_memory``), never as state on the model's modules.
"""

from __future__ import annotations

import dataclasses
import hashlib
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from hf_memory import BankSet, CAAVectors, Selector, apply_caa, steer
from hf_memory.chat.generation import default_system_prompt

__all__ = ["HFMemoryLM", "steering_record"]


def _given(value: Any) -> bool:
    return value is not None and value != ""


@register_model("hf-memory")
class HFMemoryLM(HFLM):
    """``HFLM`` steered by memory banks + a selector, CAA vectors + a scale, or a prompt.

    ``banks`` / ``selector`` / ``caa`` take a directory (``save_pretrained``) or the loaded
    object; everything else goes to ``HFLM`` (``pretrained`` may be a model object, then give
    ``tokenizer``)."""

    def __init__(self, pretrained: Any, banks: Any = None, selector: Any = None,
                 caa: Any = None, scale: float | str | None = None, prompt: str | None = None,
                 **kwargs: Any) -> None:
        given = [name for name, value in (("banks", banks), ("caa", caa), ("prompt", prompt))
                 if _given(value)]
        if len(given) > 1:
            raise ValueError(f"choose one steering: {' and '.join(given)} were both given")
        if _given(selector) and not _given(banks):
            raise ValueError("a selector steers banks: give banks with it")
        if _given(banks) and not _given(selector):
            raise ValueError("banks need a selector (the sites to steer): give selector=DIR")
        if _given(scale) and not _given(caa):
            raise ValueError("scale is the CAA vectors' strength: give caa with it")
        super().__init__(pretrained=pretrained, **kwargs)
        launch = getattr(self, "accelerator", None)  # set by HFLM under a multi-process launch
        if launch is not None and launch.num_processes > 1 and self._world_size == 1:
            # HFLM shards the requests across an ``accelerate launch``'s processes only when it
            # counts several GPUs; without GPUs (gloo) each process would score every document.
            self._rank, self._world_size = launch.process_index, launch.num_processes
        self.banks = self.selector = self.caa = None
        self.scale: float | None = None
        self.prompt = prompt if _given(prompt) else None
        self._chat = False  # set when lm-eval renders contexts through the chat template
        if _given(banks):
            self.banks = (banks if isinstance(banks, BankSet)
                          else BankSet.from_pretrained(banks, model=self.model))
            self.banks.check_model(self.model)
            self.selector = (selector if isinstance(selector, Selector)
                             else Selector.from_pretrained(selector, model=self.model))
            self.selector.check_model(self.model)
        elif _given(caa):
            self.caa = caa if isinstance(caa, CAAVectors) else CAAVectors.from_pretrained(caa)
            self.caa.check_model(self.model)
            self.scale = self.caa.scale if not _given(scale) else float(scale)

    def steering(self) -> AbstractContextManager:
        """What to hold around one forward call: the banks or the vectors, else nothing."""
        if self.banks is not None:
            return steer(self.model, self.banks, selector=self.selector)
        if self.caa is not None:
            return apply_caa(self.model, self.caa, scale=self.scale)
        return nullcontext()

    def _model_call(self, *args: Any, **kwargs: Any):
        with self.steering():
            return super()._model_call(*args, **kwargs)

    def _model_generate(self, *args: Any, **kwargs: Any):
        with self.steering():
            return super()._model_generate(*args, **kwargs)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        if self.prompt is not None:
            self._chat = True
            history = [dict(m) for m in chat_history]
            if history and history[0]["role"] == "system":
                history[0]["content"] = f"{history[0]['content']}\n{self.prompt}"
            else:
                default = default_system_prompt(self.tokenizer)
                system = f"{default}\n{self.prompt}" if default else self.prompt
                history.insert(0, {"role": "system", "content": system})
            chat_history = history
        return super().apply_chat_template(chat_history, add_generation_prompt)

    def _with_prompt(self, requests: list) -> list:
        """The requests with the prompt before each context (raw, not chat-templated, text)."""
        if self.prompt is None or self._chat:
            return requests
        return [dataclasses.replace(r, arguments=(f"{self.prompt}\n\n{r.args[0]}", *r.args[1:]))
                for r in requests]

    def loglikelihood(self, requests: list, disable_tqdm: bool = False):
        return super().loglikelihood(self._with_prompt(requests), disable_tqdm=disable_tqdm)

    def generate_until(self, requests: list, disable_tqdm: bool = False):
        return super().generate_until(self._with_prompt(requests), disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False):
        if self.prompt is not None:
            raise ValueError("the prompt method has no place in loglikelihood_rolling (it "
                             "scores whole texts with no context); use banks or CAA there")
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)


def _vectors_sha256(vectors: CAAVectors) -> str:
    digest = hashlib.sha256()
    for layer, vector in vectors.vectors.items():
        digest.update(str(layer).encode())
        digest.update(vector.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def steering_record(lm: HFMemoryLM) -> dict[str, Any]:
    """Method, artifacts and their hashes of ``lm``'s steering (for the results file)."""
    if lm.banks is not None:
        return {"method": "memory", "banks": lm.banks.audit(),
                "sites": {str(k): v for k, v in lm.selector.units.items()},
                "unit_type": lm.selector.unit_type}
    if lm.caa is not None:
        return {"method": "caa", "layers": lm.caa.layers, "scale": lm.scale,
                "site": lm.caa.site, "vectors_sha256": _vectors_sha256(lm.caa),
                "pairs_sha256": lm.caa.provenance.get("pairs_sha256")}
    if lm.prompt is not None:
        return {"method": "prompt", "text": lm.prompt,
                "placement": "system" if lm._chat else "prepend"}
    return {"method": "plain"}
