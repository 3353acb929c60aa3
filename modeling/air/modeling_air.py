"""AIRSolver: a shared recurrent transformer updating two latent states, z_H and z_L.

One segment runs the sub-steps ``(L × L_cycles, H) × H_cycles`` (L,L,H,L,L,H by default):

    L-update:  z_L ← f(z_L + u_L(z_H, x))        H-update:  z_H ← f(z_H + u_H(z_L, x))

with ``u(z_other, x) = z_other + n·x`` (``n`` from ``config.injection``; Lx_H: n_L = 1, n_H = 0),
``f`` one non-causal post-norm transformer block (RoPE, SwiGLU) shared by both updates, and the
encoded input ``x`` = token embeddings with a learned puzzle prefix. Only the last L- and the last
H-update carry gradient (one-step gradient). The output head decodes z_H; the ACT Q-head reads
z_H's first position. See README.md beside this file for the maths and the variants.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_air import AIRConfig

__all__ = [
    "AIRBlock",
    "AIRCarry",
    "AIROutput",
    "AIRSolution",
    "AIRSolver",
    "log_stablemax",
    "stablemax_cross_entropy",
]

IGNORE_LABEL = -100


def variance_corrected_trunc_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Fill ``tensor`` from a normal truncated at ±2 of its own scale, with that scale chosen so
    the *drawn* values have standard deviation ``std`` (the authors' initialiser; plain
    ``nn.init.trunc_normal_(std=s, a=-2s, b=2s)`` gives 0.88·s)."""
    if std == 0:
        return nn.init.zeros_(tensor)
    beta = 2.0
    density = math.exp(-beta * beta / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(beta / math.sqrt(2))  # P(|z| < beta)
    scale = std / math.sqrt(1 - 2 * beta * density / mass)
    return nn.init.trunc_normal_(tensor, std=scale, a=-beta * scale, b=beta * scale)


def _stablemax_s(x: torch.Tensor) -> torch.Tensor:
    # the 1 / (1 - x) branch sees 0 where x >= 0: evaluated at x = 1 its infinite slope would
    # turn the masked gradient into inf * 0 = NaN
    negative = x < 0
    return torch.where(negative, 1 / (1 - torch.where(negative, x, 0.0)), x + 1)


def log_stablemax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log s(x_i) − log Σ_j s(x_j)`` with ``s(x) = x + 1`` for ``x ≥ 0`` else ``1 / (1 − x)``."""
    s = _stablemax_s(logits)
    return torch.log(s / s.sum(dim=dim, keepdim=True))


def stablemax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token stablemax cross-entropy in float64 (0 where ``labels == -100``)."""
    valid = labels != IGNORE_LABEL
    logprobs = log_stablemax(logits.to(torch.float64))
    picked = torch.gather(logprobs, -1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, -picked, 0.0)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    flat = F.cross_entropy(_at_least_fp32(logits).flatten(0, -2), labels.flatten(),
                           ignore_index=IGNORE_LABEL, reduction="none")
    return flat.view(labels.shape)


def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free RMSNorm, computed in (at least) float32."""
    x32 = _at_least_fp32(x)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class AIRRotary(nn.Module):
    """RoPE tables for positions ``0 .. max_len-1`` (non-persistent buffers)."""

    def __init__(self, head_dim: int, max_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(self.max_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:length].to(dtype), self.sin[:length].to(dtype)


class AIRAttention(nn.Module):
    """Non-causal multi-head self-attention with RoPE; SDPA unless weights are requested."""

    def __init__(self, config: AIRConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden.shape
        qkv = self.qkv_proj(hidden).view(batch, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if output_attentions:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
            weights = _at_least_fp32(scores).softmax(-1).to(q.dtype)
            out = weights @ v
        else:
            weights = None
            out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out), weights


class AIRMLP(nn.Module):
    """SwiGLU feed-forward layer."""

    def __init__(self, config: AIRConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class AIRLayer(nn.Module):
    """Post-norm transformer layer: ``h = norm(h + attn(h)); h = norm(h + mlp(h))``."""

    def __init__(self, config: AIRConfig) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.self_attn = AIRAttention(config)
        self.mlp = AIRMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, weights = self.self_attn(hidden, cos, sin, output_attentions)
        hidden = _rms_norm(hidden + attn, self.eps)
        return _rms_norm(hidden + self.mlp(hidden), self.eps), weights


class AIRBlock(nn.Module):
    """The recurrent map ``f``: ``num_hidden_layers`` layers over the whole sequence.

    ``level`` ("L" or "H") names the update being computed; the block's weights do not depend on
    it (the model applies level tokens before calling it), so hooks can record the schedule.
    """

    def __init__(self, config: AIRConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AIRLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, level: str,
                output_attentions: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        maps = []
        for layer in self.layers:
            hidden, weights = layer(hidden, cos, sin, output_attentions)
            if output_attentions:
                maps.append(weights)
        return hidden, tuple(maps)


@dataclass
class AIRCarry:
    """What persists across segments (and across training batches): both states, the segment
    count and halting flag of every row, and the puzzle each row is working on. ``z_L`` is None
    for the single-state ablation. Tensors are detached."""

    z_H: torch.Tensor
    z_L: torch.Tensor | None
    steps: torch.Tensor
    halted: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor | None
    puzzle_identifiers: torch.Tensor


@dataclass
class AIROutput(ModelOutput):
    """One segment of :meth:`AIRSolver.forward`.

    Attributes:
        loss: ``lm_loss + 0.5 · (q_halt_loss + q_continue_loss)`` when labels are given.
        lm_loss: mean over rows of each row's mean per-cell cross-entropy (stablemax or softmax).
        q_halt_loss: BCE of the halt logit against "the row's prediction is exactly right".
        q_continue_loss: BCE of the continue logit against the bootstrapped target (training).
        logits: ``[B, seq_len, vocab]`` decoded from z_H.
        q_halt_logits, q_continue_logits: ``[B]``.
        target_q_continue: ``[B]`` the bootstrapped Q target (training with ACT only).
        carry: the new :class:`AIRCarry` (detached).
        is_correct: ``[B]`` exact match of the argmax against the labels.
        sub_steps: the update order, e.g. ``("L", "L", "H", "L", "L", "H")``.
        z_H_logits, z_L_logits: ``[n_sub_steps, B, seq_len, vocab]`` — both states decoded with
            the output head after every sub-step (``return_intermediate=True``).
        attentions: per sub-step, per layer ``[B, heads, S, S]`` over the block's whole input
            (level token, puzzle prefix, cells) (``output_attentions=True``).
    """

    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    q_halt_loss: torch.Tensor | None = None
    q_continue_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    q_halt_logits: torch.Tensor | None = None
    q_continue_logits: torch.Tensor | None = None
    target_q_continue: torch.Tensor | None = None
    carry: AIRCarry | None = None
    is_correct: torch.Tensor | None = None
    sub_steps: tuple[str, ...] | None = None
    z_H_logits: torch.Tensor | None = None
    z_L_logits: torch.Tensor | None = None
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None


@dataclass
class AIRSolution(ModelOutput):
    """Result of :meth:`AIRSolver.solve`: final ``predictions`` ``[B, seq_len]`` and their
    ``logits``, ``segments`` ``[B]`` used per row, and per segment the :class:`AIROutput`
    (``trace``, when requested)."""

    predictions: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    q_halt_logits: torch.Tensor | None = None
    trace: list[AIROutput] | None = None


class AIRPreTrainedModel(PreTrainedModel):
    config_class = AIRConfig
    base_model_prefix = "air"
    main_input_name = "input_ids"
    _no_split_modules = ["AIRBlock"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """LeCun truncated normal (variance-corrected, as the authors' code) for linear maps and
        embeddings, zero puzzle embeddings and level tokens, and the Q-head starting at
        "continue" (weight 0, bias −5)."""
        if isinstance(module, nn.Linear):
            variance_corrected_trunc_normal_(module.weight, 1.0 / math.sqrt(module.in_features))
        elif isinstance(module, nn.Embedding):
            variance_corrected_trunc_normal_(module.weight, 1.0 / math.sqrt(module.embedding_dim))
        elif isinstance(module, AIRRotary):
            cos, sin = module._tables()
            module.cos.copy_(cos)
            module.sin.copy_(sin)
        if isinstance(module, AIRSolver):
            for name in ("H_init", "L_init"):
                variance_corrected_trunc_normal_(getattr(module, name),
                                                 self.config.initial_state_std)
            if module.puzzle_emb is not None:
                nn.init.zeros_(module.puzzle_emb.weight)
            nn.init.zeros_(module.q_head.weight)
            nn.init.constant_(module.q_head.bias, -5.0)
            if module.level_emb is not None:
                nn.init.zeros_(module.level_emb)


class AIRSolver(AIRPreTrainedModel):
    """The shared-weight two-state recurrent solver with ACT halting (see module docstring)."""

    def __init__(self, config: AIRConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed_scale = math.sqrt(d)
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.puzzle_emb = (nn.Embedding(config.num_puzzle_identifiers, config.puzzle_emb_len * d)
                           if config.puzzle_emb_len else None)
        if config.share_weights:
            self.block = AIRBlock(config)
        else:
            self.L_block = AIRBlock(config)
            self.H_block = AIRBlock(config)
        self.injection_counts = config.injection_counts
        self.input_proj = (nn.Linear(d, d, bias=False)
                           if config.input_operator in ("linear", "nonlinear") else None)
        self.level_emb = nn.Parameter(torch.empty(2, d)) if config.level_token else None
        no_strip = config.level_token == "prepend_no_strip"
        self.state_offset = config.puzzle_emb_len + int(no_strip)
        self.state_len = self.state_offset + config.seq_len
        self.rotary = AIRRotary(d // config.num_attention_heads, self.state_len + 1,
                                config.rope_theta)
        self.register_buffer("H_init", torch.empty(d), persistent=True)
        self.register_buffer("L_init", torch.empty(d), persistent=True)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.q_head = nn.Linear(d, 2, bias=True)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # ----------------------------------------------------------------- inputs and states
    def block_for(self, level: str) -> AIRBlock:
        """The network computing ``level``'s update (one shared block unless HRM-style)."""
        if self.config.share_weights:
            return self.block
        return self.L_block if level == "L" else self.H_block

    def _check_inputs(self, input_ids: torch.Tensor,
                      puzzle_identifiers: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] != self.config.seq_len:
            raise ValueError(
                f"input_ids must have shape [batch, {self.config.seq_len}] (config.seq_len), "
                f"got {tuple(input_ids.shape)}"
            )
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, {self.config.vocab_size}) (config.vocab_size), got "
                f"values in [{int(input_ids.min())}, {int(input_ids.max())}]"
            )
        if puzzle_identifiers is None:
            return torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        if puzzle_identifiers.shape != input_ids.shape[:1]:
            raise ValueError(
                f"puzzle_identifiers must have shape [{input_ids.shape[0]}], got "
                f"{tuple(puzzle_identifiers.shape)}"
            )
        if puzzle_identifiers.numel() and (
            puzzle_identifiers.min() < 0
            or puzzle_identifiers.max() >= self.config.num_puzzle_identifiers
        ):
            raise ValueError(
                f"puzzle_identifiers must lie in [0, {self.config.num_puzzle_identifiers}) "
                "(config.num_puzzle_identifiers)"
            )
        return puzzle_identifiers.long()

    def encode_input(self, input_ids: torch.Tensor,
                     puzzle_identifiers: torch.Tensor) -> torch.Tensor:
        """``x``: ``sqrt(d)·[puzzle prefix ; token embeddings]``, laid out like the states (a zero
        row first under ``prepend_no_strip``, where the level token owns position 0)."""
        x = self.embed_tokens(input_ids)
        batch, d = x.shape[0], x.shape[-1]
        if self.puzzle_emb is not None:
            prefix = self.puzzle_emb(puzzle_identifiers).view(batch, self.config.puzzle_emb_len, d)
            x = torch.cat((prefix.to(x.dtype), x), dim=1)
        if self.config.level_token == "prepend_no_strip":
            x = torch.cat((x.new_zeros(batch, 1, d), x), dim=1)
        return x * self.embed_scale

    def initial_states(self, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Broadcast copies of the fixed initial vectors (with the level tokens at position 0
        under ``prepend_no_strip``)."""
        shape = (batch, self.state_len, self.config.hidden_size)
        z_H = self.H_init.expand(shape).clone()
        z_L = None if self.config.single_state else self.L_init.expand(shape).clone()
        if self.config.level_token == "prepend_no_strip":
            z_H[:, 0] = self.level_emb[1]
            z_L[:, 0] = self.level_emb[0]
        return z_H, z_L

    def initial_carry(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                      puzzle_identifiers: torch.Tensor | None = None) -> AIRCarry:
        """A carry whose every row is halted, so the next segment starts them all afresh."""
        puzzle_identifiers = self._check_inputs(input_ids, puzzle_identifiers)
        z_H, z_L = self.initial_states(input_ids.shape[0])
        batch = input_ids.shape[0]
        return AIRCarry(
            z_H=z_H, z_L=z_L,
            steps=torch.zeros(batch, dtype=torch.long, device=input_ids.device),
            halted=torch.ones(batch, dtype=torch.bool, device=input_ids.device),
            input_ids=input_ids, labels=labels, puzzle_identifiers=puzzle_identifiers,
        )

    # ----------------------------------------------------------------- the recurrence
    def _update_input(self, level: str, z_self: torch.Tensor, z_other: torch.Tensor | None,
                      x: torch.Tensor) -> torch.Tensor:
        """``z_self + u(z_other, x)``: what ``f`` receives for a ``level`` update, summed in the
        authors' order ``z_self + (z_other + n·g(x))``."""
        n = self.injection_counts[0 if level == "L" else 1]
        operator = self.config.input_operator
        if n == 0:
            return z_self if z_other is None else z_self + z_other
        if operator == "hadamard":
            gate = z_self if z_other is None else z_other + z_self
            return z_self + gate * (n * x)
        if operator == "linear":
            x = self.input_proj(x)
        elif operator == "nonlinear":
            x = torch.tanh(self.input_proj(x))
        elif operator == "sign_flip":
            x = -x
        return z_self + n * x if z_other is None else z_self + (z_other + n * x)

    def _apply_block(self, level: str, hidden: torch.Tensor, output_attentions: bool
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        level_token = self.config.level_token
        index = 0 if level == "L" else 1
        if level_token == "addition":
            hidden = hidden + self.level_emb[index]
        elif level_token == "prepend_strip":
            token = self.level_emb[index].to(hidden.dtype).expand(hidden.shape[0], 1, -1)
            hidden = torch.cat((token, hidden), dim=1)
        cos, sin = self.rotary(hidden.shape[1], hidden.dtype)
        out, maps = self.block_for(level)(hidden, cos, sin, level=level,
                                          output_attentions=output_attentions)
        if level_token == "prepend_strip":
            out = out[:, 1:]
        return out, maps

    def run_segment(self, z_H: torch.Tensor, z_L: torch.Tensor | None, x: torch.Tensor,
                    freeze_state: str | None = None, return_intermediate: bool = False,
                    output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None,
                                                              dict]:
        """Every sub-step of one segment. Returns the new ``(z_H, z_L)`` and a trace dict with
        ``z_H_logits`` / ``z_L_logits`` / ``attentions`` lists when requested. Under
        ``freeze_state="H"`` (``"L"``) the H- (L-) updates are skipped: that state stays fixed."""
        if freeze_state not in (None, "H", "L"):
            raise ValueError(f"freeze_state must be None, 'H' or 'L', got {freeze_state!r}")
        single = self.config.single_state
        steps = self.config.sub_steps
        last_L = len(steps) - 1 - steps[::-1].index("L")
        trace: dict[str, list] = {"z_H_logits": [], "z_L_logits": [], "attentions": []}
        for index, level in enumerate(steps):
            with_grad = self.config.full_backprop or index >= last_L
            with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
                if freeze_state != level:
                    if single:
                        z_H, maps = self._apply_block(
                            level, self._update_input(level, z_H, None, x), output_attentions)
                    elif level == "L":
                        z_L, maps = self._apply_block(
                            "L", self._update_input("L", z_L, z_H, x), output_attentions)
                    else:
                        z_H, maps = self._apply_block(
                            "H", self._update_input("H", z_H, z_L, x), output_attentions)
                else:
                    maps = ()
            if return_intermediate:
                with torch.no_grad():
                    trace["z_H_logits"].append(self.decode(z_H))
                    if z_L is not None:
                        trace["z_L_logits"].append(self.decode(z_L))
            if output_attentions:
                trace["attentions"].append(maps)
        return z_H, z_L, trace

    def decode(self, state: torch.Tensor) -> torch.Tensor:
        """The output head on a state's cell positions: ``[B, seq_len, vocab]``."""
        return self.lm_head(state[:, self.state_offset:])

    def q_logits(self, z_H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_halt, q_continue)`` from the Q-head on z_H's first position."""
        q = _at_least_fp32(self.q_head(z_H[:, 0]))
        return q[:, 0], q[:, 1]

    # ----------------------------------------------------------------- segments
    def _reset(self, carry: AIRCarry, input_ids: torch.Tensor, labels: torch.Tensor | None,
               puzzle_identifiers: torch.Tensor) -> AIRCarry:
        """Halted rows start afresh on the new batch's puzzle; the others keep theirs."""
        halted = carry.halted
        if carry.z_H.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"carry holds {carry.z_H.shape[0]} rows but the batch has {input_ids.shape[0]}"
            )
        if labels is None:
            keep_labels = None
        elif carry.labels is not None:
            keep_labels = torch.where(halted.view(-1, 1), labels, carry.labels)
        elif bool(halted.all()):
            keep_labels = labels
        else:
            raise ValueError("the carry's unfinished rows hold puzzles without labels; start a "
                             "labelled run from carry=None")
        z_H0, z_L0 = self.initial_states(input_ids.shape[0])
        rows = halted.view(-1, 1, 1)
        return AIRCarry(
            z_H=torch.where(rows, z_H0.to(carry.z_H.dtype), carry.z_H),
            z_L=None if z_L0 is None else torch.where(rows, z_L0.to(carry.z_L.dtype), carry.z_L),
            steps=torch.where(halted, 0, carry.steps),
            halted=halted,
            input_ids=torch.where(halted.view(-1, 1), input_ids, carry.input_ids),
            labels=keep_labels,
            puzzle_identifiers=torch.where(halted, puzzle_identifiers, carry.puzzle_identifiers),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        carry: AIRCarry | None = None,
        puzzle_identifiers: torch.Tensor | None = None,
        return_intermediate: bool = False,
        output_attentions: bool = False,
        freeze_state: str | None = None,
    ) -> AIROutput:
        """Run one segment.

        Rows the ``carry`` marks halted (all rows when ``carry`` is None) restart from the initial
        states on this batch's puzzle; the other rows continue the puzzle they hold. After the
        segment a row halts when it reached ``halt_max_steps`` segments, or — in training — when
        its Q-head prefers halting, unless exploration (probability ``halt_exploration_prob``)
        drew a larger minimum number of segments for it.
        """
        puzzle_identifiers = self._check_inputs(input_ids, puzzle_identifiers)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(labels.shape)}")
        if carry is None:
            carry = self.initial_carry(input_ids, labels, puzzle_identifiers)
        carry = self._reset(carry, input_ids, labels, puzzle_identifiers)
        x = self.encode_input(carry.input_ids, carry.puzzle_identifiers)
        z_H, z_L, trace = self.run_segment(carry.z_H, carry.z_L, x, freeze_state,
                                           return_intermediate, output_attentions)
        logits = self.decode(z_H)
        q_halt, q_continue = self.q_logits(z_H)

        steps = carry.steps + 1
        max_steps = self.config.halt_max_steps
        halted = steps >= max_steps
        target_q_continue = None
        if self.training and max_steps > 1:
            halted = halted | (q_halt > q_continue)
            explore = torch.rand_like(q_halt) < self.config.halt_exploration_prob
            min_steps = torch.randint_like(steps, 2, max_steps + 1) * explore
            halted = halted & (steps >= min_steps) | (steps >= max_steps)
            with torch.no_grad():
                next_H, _, _ = self.run_segment(z_H.detach(), None if z_L is None else z_L.detach(),
                                                x.detach(), freeze_state)
                next_halt, next_continue = self.q_logits(next_H)
                target_q_continue = torch.sigmoid(torch.where(
                    steps >= max_steps, next_halt, torch.maximum(next_halt, next_continue)))
        new_carry = AIRCarry(
            z_H=z_H.detach(), z_L=None if z_L is None else z_L.detach(), steps=steps,
            halted=halted, input_ids=carry.input_ids, labels=carry.labels,
            puzzle_identifiers=carry.puzzle_identifiers,
        )
        output = AIROutput(
            logits=logits, q_halt_logits=q_halt, q_continue_logits=q_continue,
            target_q_continue=target_q_continue, carry=new_carry,
            sub_steps=self.config.sub_steps,
        )
        if return_intermediate:
            output.z_H_logits = torch.stack(trace["z_H_logits"])
            output.z_L_logits = torch.stack(trace["z_L_logits"]) if z_L is not None else None
        if output_attentions:
            output.attentions = tuple(trace["attentions"])
        if carry.labels is not None:
            self._add_losses(output, carry.labels)
        return output

    def _add_losses(self, output: AIROutput, labels: torch.Tensor) -> None:
        valid = labels != IGNORE_LABEL
        counts = valid.sum(-1).clamp_min(1)
        if self.config.loss_type == "stablemax":
            per_token = stablemax_cross_entropy(output.logits, labels)
        else:
            per_token = _softmax_cross_entropy(output.logits, labels)
        lm_loss = (per_token.sum(-1) / counts).mean().to(output.logits.dtype)
        with torch.no_grad():
            correct = (output.logits.argmax(-1) == labels) | ~valid
            is_correct = correct.all(-1)
        q_halt_loss = F.binary_cross_entropy_with_logits(output.q_halt_logits,
                                                         is_correct.to(output.q_halt_logits.dtype))
        loss = lm_loss + 0.5 * q_halt_loss
        if output.target_q_continue is not None:
            output.q_continue_loss = F.binary_cross_entropy_with_logits(
                output.q_continue_logits, output.target_q_continue)
            loss = loss + 0.5 * output.q_continue_loss
        output.loss, output.lm_loss, output.q_halt_loss = loss, lm_loss, q_halt_loss
        output.is_correct = is_correct

    # ----------------------------------------------------------------- inference
    @torch.no_grad()
    def iter_segments(
        self,
        input_ids: torch.Tensor,
        puzzle_identifiers: torch.Tensor | None = None,
        max_segments: int | None = None,
        freeze_state: str | None = None,
        return_intermediate: bool = False,
        output_attentions: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict]]:
        """Run ``max_segments`` (default ``halt_max_steps``) segments from fresh states, no
        halting, yielding ``(z_H entering the segment, z_H, z_L, run_segment trace)`` for each —
        one segment's attention maps at a time."""
        max_segments = self.config.halt_max_steps if max_segments is None else max_segments
        if isinstance(max_segments, bool) or not isinstance(max_segments, int) or max_segments < 1:
            raise ValueError(f"max_segments must be a positive integer, got {max_segments!r}")
        puzzle_identifiers = self._check_inputs(input_ids, puzzle_identifiers)
        x = self.encode_input(input_ids, puzzle_identifiers)
        z_H, z_L = self.initial_states(input_ids.shape[0])
        for _ in range(max_segments):
            z_H_in = z_H
            z_H, z_L, trace = self.run_segment(z_H, z_L, x, freeze_state, return_intermediate,
                                               output_attentions)
            yield z_H_in, z_H, z_L, trace

    @torch.no_grad()
    def solve(
        self,
        input_ids: torch.Tensor,
        puzzle_identifiers: torch.Tensor | None = None,
        max_segments: int | None = None,
        halting: str = "max",
        return_trace: bool = False,
        return_intermediate: bool = False,
        output_attentions: bool = False,
        freeze_state: str | None = None,
    ) -> AIRSolution:
        """Run segments from fresh states until every row halts and return the predictions.

        ``halting="max"`` runs ``max_segments`` (default ``halt_max_steps``) segments, as the
        papers evaluate; ``halting="q"`` stops a row at the first segment whose Q-head prefers
        halting (its prediction is then frozen). ``return_trace`` keeps each segment's
        :class:`AIROutput` (with sub-step decodings / attention maps when requested).
        """
        if halting not in ("max", "q"):
            raise ValueError(f"halting must be 'max' or 'q', got {halting!r}")
        batch = input_ids.shape[0]
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        segments = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        logits = q_halt = None
        trace = [] if return_trace else None
        for _, z_H, z_L, sub in self.iter_segments(input_ids, puzzle_identifiers, max_segments,
                                                   freeze_state, return_intermediate,
                                                   output_attentions):
            new_logits = self.decode(z_H)
            new_halt, new_continue = self.q_logits(z_H)
            active = ~done
            logits = new_logits if logits is None else torch.where(
                active.view(-1, 1, 1), new_logits, logits)
            q_halt = new_halt if q_halt is None else torch.where(active, new_halt, q_halt)
            segments = segments + active.long()
            if return_trace:
                trace.append(AIROutput(
                    logits=new_logits, q_halt_logits=new_halt, q_continue_logits=new_continue,
                    sub_steps=self.config.sub_steps,
                    z_H_logits=torch.stack(sub["z_H_logits"]) if return_intermediate else None,
                    z_L_logits=(torch.stack(sub["z_L_logits"])
                                if return_intermediate and z_L is not None else None),
                    attentions=tuple(sub["attentions"]) if output_attentions else None,
                ))
            if halting == "q":
                done = done | (new_halt > new_continue)
                if bool(done.all()):
                    break
        return AIRSolution(predictions=logits.argmax(-1), logits=logits, segments=segments,
                           q_halt_logits=q_halt, trace=trace)


AIRConfig.register_for_auto_class()
AIRSolver.register_for_auto_class("AutoModel")
