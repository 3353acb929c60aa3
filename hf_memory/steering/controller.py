"""A bank controller that rides along in ``generate()``: it switches banks at given steps or
tokens (a stopping criterion that never stops)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria

from hf_memory.banks.bank import MemoryBank
from hf_memory.banks.bank_set import BankSet
from hf_memory.steering.handle import SteeringHandle

__all__ = ["BankController", "Switch"]


@dataclass
class Switch:
    """Replace the banks at a token boundary.

    ``at_token=N``: the first N generated tokens come from the old banks, the rest from
    ``banks``. ``on_token_ids``: switch as soon as any row generates one of these tokens (e.g.
    the end of a turn); the tokens after it come from ``banks``.
    """

    banks: BankSet | Sequence[MemoryBank]
    at_token: int | None = None
    on_token_ids: Iterable[int] | None = None

    def __post_init__(self) -> None:
        if (self.at_token is None) == (self.on_token_ids is None):
            raise ValueError("a Switch needs exactly one of at_token or on_token_ids")
        if self.at_token is not None and self.at_token < 1:
            raise ValueError(f"at_token must be >= 1, got {self.at_token}")
        if self.on_token_ids is not None:
            self.on_token_ids = frozenset(int(t) for t in self.on_token_ids)


class BankController(StoppingCriteria):
    """Switch banks by schedule or trigger during ``generate()`` and trace the routing.

    Pass it as ``stopping_criteria=[controller]`` inside ``with steer(...) as handle``; it never
    stops generation. It rides on the stopping-criteria hook rather than on a logits processor
    because that hook sees each token right after it is chosen and before the forward pass
    that consumes it — the only exact token boundary (a logits processor runs before the token
    exists, so a token trigger would act one token late). A switch affects later forward passes
    only: earlier tokens and their cache are never touched. ``trace`` holds, per generated
    token, the routing mass of the prompt and of each bank that produced it (mean over steered
    layers and heads, newest position): ``[B, 1 + n_banks]``.
    """

    def __init__(self, handle: SteeringHandle, switches: Sequence[Switch] = (), *,
                 prompt_length: int) -> None:
        self.handle = handle
        self.pending = list(switches)
        self.prompt_length = prompt_length
        self.trace: list[dict] = []
        self.events: list[dict] = []
        handle.record_routing()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor,
                 **kwargs) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_length
        routing = [r[-1][:, :, -1] for r in self.handle.routing(clear=True).values() if r]
        if routing:
            mass = torch.stack([r.mean(dim=1) for r in routing]).mean(dim=0)
            self.trace.append({"token": generated,
                               "banks": [b.name for b in self.handle.bank_set],
                               "mass": mass.detach().cpu()})
        for switch in list(self.pending):
            due = (switch.at_token is not None and generated >= switch.at_token) or (
                switch.on_token_ids is not None
                and any(int(t) in switch.on_token_ids for t in input_ids[:, -1]))
            if due:
                self.handle.update(switch.banks)
                self.pending.remove(switch)
                self.events.append({"after_token": generated,
                                    "banks": [b.name for b in self.handle.bank_set]})
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
