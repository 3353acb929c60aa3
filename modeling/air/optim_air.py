"""Optimisation pieces for training the AIRSolver, following the HRM recipe.

* :class:`AdamATan2`: Adam with the ``m / (sqrt(v) + eps)`` division replaced by
  ``a * atan2(m, b * sqrt(v))`` (Everett et al. 2024, "Scaling exponents across
  parameterizations and optimizers"), with decoupled (AdamW-style) weight decay and no ``eps``.
  :func:`adam_atan2_reference_step` is the same update written directly from the formulas.
* :func:`warmup_schedule` / :func:`make_scheduler`: linear warmup, then cosine decay to
  ``min_ratio`` of the base learning rate.
* :class:`EMA`: an exponential moving average of a model's parameters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "EMA",
    "AdamATan2",
    "adam_atan2_reference_step",
    "make_scheduler",
    "warmup_schedule",
]


def _check_hyperparameters(
    lr: float, betas: tuple[float, float], weight_decay: float, a: float, b: float
) -> None:
    if not lr >= 0.0:
        raise ValueError(f"AdamATan2: lr must be >= 0, got {lr!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"AdamATan2: betas[{i}] must be in [0, 1), got {beta!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"AdamATan2: weight_decay must be >= 0, got {weight_decay!r}")
    if not a > 0.0:
        raise ValueError(f"AdamATan2: a must be > 0, got {a!r}")
    if not b > 0.0:
        raise ValueError(f"AdamATan2: b must be > 0, got {b!r}")


class AdamATan2(torch.optim.Optimizer):
    """Adam whose step direction is ``a * atan2(m_hat, b * sqrt(v_hat))`` (no ``eps``).

    Per parameter ``p`` with gradient ``g`` at step ``t`` (counted from 1)::

        p     <- p * (1 - lr * weight_decay)                (decoupled weight decay)
        m     <- beta1 * m + (1 - beta1) * g
        v     <- beta2 * v + (1 - beta2) * g * g
        m_hat  = m / (1 - beta1 ** t),   v_hat = v / (1 - beta2 ** t)
        p     <- p - lr * a * atan2(m_hat, b * sqrt(v_hat))

    ``atan2`` lies in ``[-pi/2, pi/2]`` because its second argument is non-negative, so each
    element moves by at most ``lr * a * pi / 2`` (plus the weight decay), needs no ``eps`` and is
    invariant to a constant positive rescaling of the gradients.

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``.
        lr: learning rate (a float, >= 0).
        betas: the moment decays ``(beta1, beta2)``, each in ``[0, 1)``; HRM uses (0.9, 0.95).
        weight_decay: decoupled weight decay coefficient (>= 0).
        a: output scale (> 0). The default 1.27 follows the public ``adam-atan2`` package.
        b: scale of ``sqrt(v_hat)`` inside ``atan2`` (> 0). The default 1.0 follows the same
            package.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        a: float = 1.27,
        b: float = 1.0,
    ) -> None:
        _check_hyperparameters(lr, betas, weight_decay, a, b)
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "a": a, "b": b}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validating its (possibly overridden) hyperparameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(
            group["lr"], group["betas"], group["weight_decay"], group["a"], group["b"]
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step; ``closure`` re-evaluates the loss, as in Adam."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, a, b = group["lr"], group["weight_decay"], group["a"], group["b"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("AdamATan2 does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]

                p.mul_(1.0 - lr * wd)
                m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                m_hat = m / (1.0 - beta1**t)
                v_hat = v / (1.0 - beta2**t)
                update = torch.atan2(m_hat, v_hat.sqrt().mul_(b)).mul_(a)
                p.add_(update, alpha=-lr)
        return loss


def adam_atan2_reference_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    a: float = 1.27,
    b: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamATan2 step on plain tensors, straight from the formulas (slow, for testing).

    ``step`` is the 1-based index of this step. Returns the new ``(p, m, v)``; inputs are
    not modified.
    """
    beta1, beta2 = betas
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    m_hat = m / (1 - beta1**step)
    v_hat = v / (1 - beta2**step)
    p = p - lr * a * torch.atan2(m_hat, b * torch.sqrt(v_hat))
    return p, m, v


def warmup_schedule(
    step: int, warmup_steps: int, total_steps: int, min_ratio: float = 1.0
) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_ratio``.

    ``step / warmup_steps`` for ``step < warmup_steps`` (so 0 at step 0), exactly 1 at
    ``step == warmup_steps``, then ``min_ratio + (1 - min_ratio) * (1 + cos(pi * q)) / 2`` with
    ``q = (step - warmup_steps) / max(1, total_steps - warmup_steps)`` clamped to ``[0, 1]``,
    so ``min_ratio`` from ``total_steps`` on. ``min_ratio=1.0`` is a constant rate after warmup.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
    if total_steps < warmup_steps:
        raise ValueError(
            f"total_steps must be >= warmup_steps ({warmup_steps}), got {total_steps!r}"
        )
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio!r}")
    if step < warmup_steps:
        return step / warmup_steps
    q = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * q))


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float = 1.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying :func:`warmup_schedule` to every param group's base lr.

    Call ``scheduler.step()`` after each ``optimizer.step()``. Steps count from 1, as in the
    authors' code: the k-th optimizer step runs at ``warmup_schedule(k, ...)``, so the first at
    ``1 / warmup_steps`` of the rate (never 0) and step ``warmup_steps`` at the full rate.
    """
    warmup_schedule(0, warmup_steps, total_steps, min_ratio)  # validate now, not at first step
    schedule = functools.partial(
        warmup_schedule, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda index: schedule(index + 1))


class EMA:
    """Exponential moving average of a model's parameters: ``ema <- decay * ema + (1 - decay) * p``.

    The average starts at the model's current parameters and is kept in at least float32.
    Buffers (e.g. normalisation statistics) are copied from the model at each update, not
    averaged. Models are matched by parameter and buffer names.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA: decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        with torch.no_grad():
            self.shadow = {
                name: p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True)
                for name, p in model.named_parameters()
            }
            self.buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}

    def _check_names(self, model: nn.Module) -> None:
        params = {name for name, _ in model.named_parameters()}
        buffers = {name for name, _ in model.named_buffers()}
        if params != set(self.shadow) or buffers != set(self.buffers):
            raise ValueError("EMA: the model's parameter/buffer names differ from the EMA's")

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current parameters into the average; copy its buffers."""
        self._check_names(model)
        for name, p in model.named_parameters():
            self.shadow[name].lerp_(p.detach().to(self.shadow[name].dtype), 1.0 - self.decay)
        for name, buf in model.named_buffers():
            self.buffers[name].copy_(buf)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's parameters and buffers with the EMA's."""
        self._check_names(model)
        for name, p in model.named_parameters():
            p.copy_(self.shadow[name])
        for name, buf in model.named_buffers():
            buf.copy_(self.buffers[name])

    @contextmanager
    def swapped(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the EMA weights into ``model``; the training weights come back
        bit-exactly on exit, also when the body raises."""
        with torch.no_grad():
            saved = [t.detach().clone() for t in _tensors(model)]
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for t, original in zip(_tensors(model), saved, strict=True):
                    t.copy_(original)

    def state_dict(self) -> dict[str, Any]:
        """The decay and copies of the averaged parameters and buffers."""
        return {
            "decay": self.decay,
            "shadow": {name: t.clone() for name, t in self.shadow.items()},
            "buffers": {name: t.clone() for name, t in self.buffers.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the names must match this EMA's."""
        if set(state_dict["shadow"]) != set(self.shadow) or set(state_dict["buffers"]) != set(
            self.buffers
        ):
            raise ValueError("EMA: state_dict names differ from the EMA's")
        decay = state_dict["decay"]
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA: decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        with torch.no_grad():
            for name, t in state_dict["shadow"].items():
                self.shadow[name].copy_(t)
            for name, t in state_dict["buffers"].items():
                self.buffers[name].copy_(t)


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]
