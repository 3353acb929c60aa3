"""ASMForCausalLM: a language model of stacked Addressed State Attention (ASA) blocks.

Each ASA head keeps ``K`` slots with learned keys. Tokens write into every slot with a
per-slot running softmax over time (a log-sum-exp scan); the read is a softmax over slots of a key
term plus ``gamma`` times a content term; the first-order read ``o_t`` is refined by a causal
linear attention over the read-weight vectors (through a slot space of width ``M``), giving
signed slot weights ``w_t`` and ``Delta_t = sum_s w_{t,s} slot_s(t)``; the head outputs
``o_t + g Delta_t``. Decoding keeps per layer and head only the slot numerators, denominators,
running maxima and the slot-space state (:class:`ASMCache`): constant memory and time per token.
See README.md beside this file for the maths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from .asm_addressing import rotate
from .asm_common import ScanState
from .asm_ops import asa_attend, causal_linear_attention, resolve_backend, slot_addressing
from .asm_recurrent import asa_attend_step, causal_linear_attention_step
from .configuration_asm import ASMConfig

__all__ = [
    "INTERVENTION_MODES",
    "ASAAttention",
    "ASMCache",
    "ASMCausalLMOutput",
    "ASMForCausalLM",
    "ASMModel",
    "ASMModelOutput",
    "ASMPreTrainedModel",
    "RefinementStats",
    "alibi_slopes",
]

# mode -> (coefficient of the parallel part, coefficient of the orthogonal part); "beta" is the
# user's scale.
INTERVENTION_MODES = ("default", "parallel_only", "orthogonal_only", "orthogonal_scaled",
                      "parallel_scaled", "none")

# transformers 5.24 renamed the cache keyword of ``forward`` and the cache field of every
# ModelOutput from ``past_key_values`` to ``cache``. This folder is copied to Hub repos on its own,
# so it reads the installed name off the library's own output class here, and nowhere else.
CACHE_NAME = ("cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)}
              else "past_key_values")


def _one_cache(cache: ASMCache | None, past_key_values: ASMCache | None) -> ASMCache | None:
    """The cache given under the current name or the legacy one (not both)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the ASMCache once, as `cache` or as `past_key_values`, not both")
    cache = past_key_values if cache is None else cache
    if cache is not None and not isinstance(cache, ASMCache):
        raise ValueError(f"the cache must be an ASMCache, got {type(cache).__name__}")
    return cache


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al.): a geometric sequence, interleaved for non-powers of 2."""
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def _rotary_tables(positions: torch.Tensor, width: int,
                   theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``([cos, cos], [-sin, sin])`` ``[B, 1, T, width]`` (float32) of the rotary map at
    ``positions [B, T]``; computed once per forward and shared by every layer."""
    half = width // 2
    inv_freq = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary map (half-split layout, a true rotation): ``x [B, H, T, d]``, ``positions [B, T]``."""
    return rotate(x, _rotary_tables(positions, x.shape[-1], theta))


@dataclass
class RefinementStats:
    """Geometry and routing statistics of one ASA layer (paper sections 4-5), for one call.

    Per-position tensors cover every position; index them with ``mask`` (``[B, T]``, True where
    the token is real) to drop padding.

    Attributes:
        alpha: ``<g Delta, o> / ||o||^2`` ``[B, H, T]`` (0 where ``o = 0``).
        orthogonal_fraction: ``||(g Delta)_perp|| / ||g Delta||`` ``[B, H, T]``.
        relative_magnitude: ``||g Delta|| / ||o||`` ``[B, H, T]``.
        slot_write_half_life: ``[B, H, K]``, the number of most recent real tokens that hold half
            of each slot's write mass at the last position of the call.
        slot_ess: effective number of slots read, ``1 / sum_s r_{t,s}^2`` ``[B, H, T]``.
        routing_inertia: ``[B, H]``, mean over consecutive real positions of the read-weight
            overlap ``sum_s min(r_{t,s}, r_{t-1,s})`` (1: routing unchanged).
        gate: the refinement gate ``g`` (scalar tensor).
        mask: ``[B, T]`` real-token mask.
    """

    alpha: torch.Tensor
    orthogonal_fraction: torch.Tensor
    relative_magnitude: torch.Tensor
    slot_write_half_life: torch.Tensor
    slot_ess: torch.Tensor
    routing_inertia: torch.Tensor
    gate: torch.Tensor
    mask: torch.Tensor


@dataclass
class _StepConstants:
    """What every layer's decode step needs beyond its weights, made once per forward
    (:meth:`build`) so the 21 steps of a token read neither the config nor the positions again.

    Attributes:
        dtype: the state's dtype, ``promote_types(hidden dtype, float32)``.
        rotary: the write keys' :func:`_rotary_tables` ``[B, 1, 1, d]`` (None without rotary).
        slot_rotary: the slot-space :func:`_rotary_tables` ``[B, 1, 1, M]`` (None without
            slot-space rotary).
        positions: ``[B, 1, 1, 1]`` position ids in float32 (recency bias).
        valid: ``[B, 1, 1, 1]`` real-token mask in float32, or None when every row is real.
        invalid: ``[B, 1, 1, 1]``, True at padding, or None when every row is real.
        write_scale: ``head_dim^-0.5 / write_temperature``.
        recency: add the recency bias.
        content_gain: ``config.content_gain``, or None without the content read.
        max_gamma: ``config.content_read_max_gamma``.
        refinement: use the slot-space refinement.
        read_temperature: ``config.read_temperature``.
        slot_dropout: ``config.slot_dropout``.
        backend: the resolved ``config.scan_backend`` (the step is taken on ``"torch"``).
    """

    dtype: torch.dtype
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    slot_rotary: tuple[torch.Tensor, torch.Tensor] | None
    positions: torch.Tensor
    valid: torch.Tensor | None
    invalid: torch.Tensor | None
    write_scale: float
    recency: bool
    content_gain: str | None
    max_gamma: float
    refinement: bool
    read_temperature: float
    slot_dropout: float
    backend: str

    @classmethod
    def build(cls, config: ASMConfig, positions: torch.Tensor, valid: torch.Tensor,
              rotary: tuple[torch.Tensor, torch.Tensor] | None,
              dtype: torch.dtype, backend: str) -> _StepConstants:
        """From ``positions, valid [B, 1]``, the write keys' rotary tables and the hidden
        states' dtype."""
        c = config
        padded = not bool(valid.all())
        slot_rope = c.use_slot_space_refinement and c.slot_space_rope
        return cls(
            dtype=torch.promote_types(dtype, torch.float32), rotary=rotary,
            slot_rotary=(_rotary_tables(positions, c.slot_space_dim, c.slot_space_rope_theta)
                         if slot_rope else None),
            positions=positions.to(torch.float32)[:, :, None, None],
            valid=valid.to(torch.float32)[:, :, None, None] if padded else None,
            invalid=~valid[:, :, None, None] if padded else None,
            write_scale=c.head_dim ** -0.5 / c.write_temperature,
            recency=c.use_recency_bias,
            content_gain=c.content_gain if c.use_content_read else None,
            max_gamma=c.content_read_max_gamma, refinement=c.use_slot_space_refinement,
            read_temperature=c.read_temperature, slot_dropout=c.slot_dropout,
            backend=backend)


@dataclass
class _StepWeights:
    """The constants one layer's decode step derives from its weights, in the state's dtype
    (``ASAAttention._step_weights``). Under ``no_grad`` they are made at the first decode step
    of a cache and kept in its :class:`ASMCacheLayer` (``step_weights``) for the later steps:
    like the state, they belong to the weights the cache was made with. With gradients on,
    every step makes them anew from the weights.

    Attributes:
        write_keys: ``[H, d, K]`` slot keys transposed, times ``head_dim^-0.5 /
            write_temperature`` (write logits ``key @ write_keys``).
        read_keys: ``[H, d, K]`` slot keys transposed, times ``head_dim^-0.5`` (the read's key
            term ``q @ read_keys``).
        recency: ``[H, 1, 1]`` recency strength times the ALiBi slopes, or None.
        gamma: ``gamma head_dim^-0.5`` (0-d; the content term is ``gamma (q scale) . slot``),
            or None without the content read.
        gate: the refinement gate ``g`` (0-d), or None without the refinement.
        slot_qkv: ``[W_q; W_k; W_v] W_in`` ``[3M, K]`` when the five slot-space maps are plain
            ``nn.Linear``s, else None (the modules are called).
    """

    write_keys: torch.Tensor
    read_keys: torch.Tensor
    recency: torch.Tensor | None
    gamma: torch.Tensor | None
    gate: torch.Tensor | None
    slot_qkv: torch.Tensor | None


def _project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``, as ``F.linear`` without the module call when it is a plain bias-free
    ``nn.Linear`` (an adapter such as peft's LoRA wraps it in another type, which is called)."""
    if type(linear) is nn.Linear and linear.bias is None:
        return F.linear(x, linear.weight)
    return linear(x)


def _content_gain(raw: torch.Tensor, gain: str, max_gamma: float) -> torch.Tensor:
    """``gamma`` from its raw parameter (see :attr:`ASAAttention.gamma`)."""
    if gain == "softplus_clamp":
        return F.softplus(raw).clamp(max=max_gamma)
    return max_gamma * torch.sigmoid(raw)


class ASMCacheLayer:
    """Decode state of one layer: the write scan (``m [B,H,K]``, ``den [B,H,K]``,
    ``num [B,H,K,d]``) and the slot-space state (``S [B,H,M,M]``, ``Z [B,H,M]``)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self) -> None:
        self.scan: ScanState | None = None
        self.slot_space: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step_weights: _StepWeights | None = None  # made by the first decode step

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.scan is not None:
            self.scan = ScanState(fn(self.scan.m), fn(self.scan.den), fn(self.scan.num))
        if self.slot_space is not None:
            self.slot_space = (fn(self.slot_space[0]), fn(self.slot_space[1]))

    def reset(self) -> None:
        self.scan = None
        self.slot_space = None
        self.step_weights = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda x: x[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an ASM cache is a running state and cannot be cropped")

    def get_max_length(self) -> int:
        return -1


class ASMCache(Cache):
    """Constant-size decode state for :class:`ASMForCausalLM` (one :class:`ASMCacheLayer` per
    layer, plus the number of positions seen and, per row, the next position id)."""

    def __init__(self, config: ASMConfig) -> None:
        super().__init__(layers=[ASMCacheLayer() for _ in range(config.num_hidden_layers)])
        self.seen_tokens = 0
        self.next_position: torch.Tensor | None = None

    @property
    def is_compileable(self) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
        self.next_position = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.next_position is not None:
            self.next_position = self.next_position.index_select(0, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.next_position is not None:
            self.next_position = self.next_position.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.next_position is not None:
            self.next_position = self.next_position[indices]

    def state_bytes(self) -> int:
        """Bytes held by the decode state (independent of the sequence length)."""
        total = 0
        for layer in self.layers:
            tensors = []
            if layer.scan is not None:
                tensors += [layer.scan.m, layer.scan.den, layer.scan.num]
            if layer.slot_space is not None:
                tensors += list(layer.slot_space)
            total += sum(x.numel() * x.element_size() for x in tensors)
        return total


class ASAAttention(nn.Module):
    """One Addressed State Attention layer: ``hidden [B, T, D]`` -> ``[B, T, D]``."""

    def __init__(self, config: ASMConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = h = config.num_attention_heads
        self.head_dim = d = config.head_dim
        self.num_slots = k = config.num_slots
        inner = h * d
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.slot_keys = nn.Parameter(torch.empty(h, k, d))
        self.recency_strength_raw = nn.Parameter(
            torch.empty(()), requires_grad=config.learn_recency_strength)
        if config.use_content_read:
            self.content_gamma_raw = nn.Parameter(torch.empty(()))
        if config.use_slot_space_refinement:
            mm = config.slot_space_dim
            self.slot_in = nn.Linear(k, mm, bias=False)
            self.slot_q = nn.Linear(mm, mm, bias=False)
            self.slot_k = nn.Linear(mm, mm, bias=False)
            self.slot_v = nn.Linear(mm, mm, bias=False)
            self.slot_out = nn.Linear(mm, k, bias=False)
            self.refinement_gate_raw = nn.Parameter(torch.empty(()))
        self.slot_space_dropout = nn.Dropout(config.dropout)
        self.intervention: tuple[list[float], list[float]] = ([1.0] * h, [1.0] * h)
        self._plain = True  # no intervention: every coefficient is 1
        self._slopes: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def reset_parameters(self) -> None:
        """Initial values of the ASA-specific parameters (the projections are nn.Linear's)."""
        c = self.config
        with torch.no_grad():
            self.slot_keys.normal_(0.0, self.head_dim ** -0.5)
            self.recency_strength_raw.fill_(math.log(math.expm1(c.recency_strength_init)))
            if c.use_content_read:
                self.content_gamma_raw.fill_(c.content_read_init)
            if c.use_slot_space_refinement:
                self.refinement_gate_raw.fill_(c.refinement_gate_init)

    @property
    def gate(self) -> torch.Tensor:
        """Refinement gate ``g = softplus(raw)`` (scalar)."""
        return F.softplus(self.refinement_gate_raw)

    @property
    def gamma(self) -> torch.Tensor:
        """Content-read weight (scalar), by ``config.content_gain``: ``"sigmoid"`` (default, the
        paper) ``gamma = max_gamma * sigmoid(raw)`` in ``(0, max_gamma)``; ``"softplus_clamp"``
        (the authors' code) ``gamma = min(softplus(raw), max_gamma)`` in ``(0, max_gamma]``,
        with zero gradient to ``raw`` where clamped."""
        c = self.config
        return _content_gain(self.content_gamma_raw, c.content_gain, c.content_read_max_gamma)

    def set_intervention(self, parallel: Sequence[float], orthogonal: Sequence[float]) -> None:
        """Per-head coefficients of the parallel and orthogonal parts of ``g Delta``."""
        self.intervention = (list(map(float, parallel)), list(map(float, orthogonal)))
        self._plain = all(x == 1.0 for x in self.intervention[0] + self.intervention[1])

    def _refine(
        self, positions: torch.Tensor, valid: torch.Tensor, layer_cache: ASMCacheLayer | None,
        backend: str,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The slot-space refinement as a closure ``r [B, H, T, K] -> w [B, H, T, K]``.

        ``positions [B, T]`` are the tokens' position ids (those of the write keys), used by
        the slot-space rotary map when ``config.slot_space_rope``; ``valid [B, T]`` leaves
        padding out of the slot-space state.

        Without a cache, slot-space dropout or adapters, and on the PyTorch backend, the values
        ``v = W_v W_in r`` are linear in ``r`` and so is the read: ``slot_out(u2)`` is the
        linear attention over the values ``r`` (``K`` wide, not ``M``) times
        ``W_out W_v W_in`` ``[K, K]``, the same maths in fewer products (the training step)."""
        c = self.config
        rope = c.slot_space_rope
        maps = (self.slot_in, self.slot_q, self.slot_k, self.slot_v, self.slot_out)
        folded = (layer_cache is None and all(type(x) is nn.Linear for x in maps)
                  and not (self.training and self.slot_space_dropout.p > 0)
                  and backend == "torch")

        def features(q_s: torch.Tensor, k_s: torch.Tensor):
            """The linear attention's feature maps ``elu + 1`` (after the slot-space rotary
            map), padding's keys zeroed."""
            if rope:
                q_s = _rotate(q_s, positions, c.slot_space_rope_theta)
                k_s = _rotate(k_s, positions, c.slot_space_rope_theta)
            return F.elu(q_s) + 1.0, (F.elu(k_s) + 1.0) * valid[:, None, :, None]

        def joint_features(qk: torch.Tensor):
            """:func:`features` of ``[q_s, k_s]`` side by side ``[B, H, T, 2M]``: without the
            rotary map, ``elu + 1`` over both at once."""
            if rope:
                return features(*qk.chunk(2, dim=-1))
            phi_q, phi_k = (F.elu(qk) + 1.0).chunk(2, dim=-1)
            return phi_q, phi_k * valid[:, None, :, None]

        def refine_folded(r: torch.Tensor) -> torch.Tensor:
            w_in = self.slot_in.weight
            r = r.to(w_in.dtype)
            qk = torch.cat((self.slot_q.weight, self.slot_k.weight)) @ w_in
            phi_q, phi_k = joint_features(F.linear(r, qk))  # [B, H, T, M]
            u, _ = causal_linear_attention(phi_q, phi_k, r, c.chunk_size, None, backend)
            out = self.slot_out.weight @ self.slot_v.weight @ w_in  # [K, K]
            return torch.tanh(F.linear(u.to(w_in.dtype), out))

        def refine(r: torch.Tensor) -> torch.Tensor:
            q_s, k_s, v_s = self._slot_qkv(r)  # [B, H, T, M]
            phi_q, phi_k = features(q_s, k_s)
            state = layer_cache.slot_space if layer_cache is not None else None
            u2, new_state = causal_linear_attention(
                phi_q, phi_k, v_s, c.chunk_size, state, backend)
            if layer_cache is not None:
                layer_cache.slot_space = new_state
            u2 = self.slot_space_dropout(u2.to(v_s.dtype))
            return torch.tanh(self.slot_out(u2))

        return refine_folded if folded else refine

    def _slot_qkv(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot-space ``q, k, v = W_{q,k,v} W_in r`` ``[B, H, T, M]`` each from ``r [B, H, T, K]``:
        one product with ``[W_q; W_k; W_v] W_in`` when the five maps are plain ``nn.Linear``s,
        module by module otherwise (adapters such as peft's LoRA wrap them)."""
        maps = (self.slot_in, self.slot_q, self.slot_k, self.slot_v)
        if any(type(x) is not nn.Linear for x in maps):
            u = self.slot_in(r.to(self.slot_in.weight.dtype))
            return self.slot_q(u), self.slot_k(u), self.slot_v(u)
        w_in = self.slot_in.weight
        qkv = torch.cat((self.slot_q.weight, self.slot_k.weight, self.slot_v.weight)) @ w_in
        return F.linear(r.to(w_in.dtype), qkv).chunk(3, dim=-1)

    def _qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, key, v`` ``[B, H, T, d]`` from ``hidden [B, T, D]``: one product with ``[W_q;
        W_k; W_v]`` when the three are plain bias-free ``nn.Linear``s, module by module
        otherwise (adapters such as peft's LoRA wrap them)."""
        b, t, _ = hidden.shape
        h, d = self.num_heads, self.head_dim
        maps = (self.q_proj, self.k_proj, self.v_proj)
        if all(type(x) is nn.Linear and x.bias is None for x in maps):
            qkv = F.linear(hidden, torch.cat([x.weight for x in maps]))
            return qkv.view(b, t, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        return tuple(x(hidden).view(b, t, h, d).transpose(1, 2) for x in maps)

    def _alibi_slopes(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """:func:`alibi_slopes` ``[H]`` as a tensor, made once per device and dtype."""
        slopes = self._slopes.get((device, dtype))
        if slopes is None:
            slopes = torch.tensor(alibi_slopes(self.num_heads), device=device, dtype=dtype)
            self._slopes[(device, dtype)] = slopes
        return slopes

    def _step_weights(self, k: _StepConstants) -> _StepWeights:
        """The constants of the decode step derived from this layer's weights (see
        :class:`_StepWeights`), in ``k.dtype``."""
        dt, scale = k.dtype, self.head_dim ** -0.5
        keys = self.slot_keys.to(dt).transpose(-1, -2)
        recency = gamma = gate = slot_qkv = None
        if k.recency:
            recency = (F.softplus(self.recency_strength_raw).to(dt)
                       * self._alibi_slopes(keys.device, dt)).view(-1, 1, 1)
        if k.content_gain is not None:
            gamma = (_content_gain(self.content_gamma_raw, k.content_gain, k.max_gamma)
                     * scale).to(dt)
        if k.refinement:
            gate = F.softplus(self.refinement_gate_raw).to(dt)
            maps = (self.slot_in, self.slot_q, self.slot_k, self.slot_v)
            if all(type(x) is nn.Linear for x in maps):
                slot_qkv = torch.cat((self.slot_q.weight, self.slot_k.weight,
                                      self.slot_v.weight)) @ self.slot_in.weight
        return _StepWeights(write_keys=(keys * k.write_scale).contiguous(),
                            read_keys=(keys * scale).contiguous(), recency=recency,
                            gamma=gamma, gate=gate, slot_qkv=slot_qkv)

    def _step(self, hidden: torch.Tensor, layer_cache: ASMCacheLayer,
              k: _StepConstants) -> torch.Tensor:
        """The decode step: :meth:`forward` for one position with a cache, no statistics and
        no intervention, in few ops (:func:`asa_attend_step`, the slot-space
        :func:`causal_linear_attention_step`, the per-token constants of ``k`` and the
        per-layer :class:`_StepWeights`, which fold the scales into the slot keys); the same
        maths as the chunk form, which it is tested against. ``hidden [B, 1, D]`` ->
        ``[B, 1, D]``."""
        if torch.is_grad_enabled():  # made anew, so gradients reach the weights every step
            w = self._step_weights(k)
        else:
            w = layer_cache.step_weights
            if w is None:
                w = layer_cache.step_weights = self._step_weights(k)
        b = hidden.shape[0]
        h, d = self.num_heads, self.head_dim
        q = _project(self.q_proj, hidden).view(b, h, 1, d)
        key = _project(self.k_proj, hidden).view(b, h, 1, d)
        v = _project(self.v_proj, hidden).view(b, h, 1, d)
        if hidden.dtype != k.dtype:
            q, key, v = q.to(k.dtype), key.to(k.dtype), v.to(k.dtype)
        if k.rotary is not None:
            cos, sin = k.rotary
            key = torch.addcmul(key * cos, key.roll(d // 2, dims=-1), sin)
        logits = key @ w.write_keys  # [B, H, 1, K]
        if w.recency is not None:
            logits = torch.addcmul(logits, w.recency, k.positions)
        if k.invalid is not None:
            logits = logits.masked_fill(k.invalid, float("-inf"))
        key_logits = q @ w.read_keys
        if self.training and k.slot_dropout > 0:
            drop = torch.rand(b, h, 1, self.num_slots, device=hidden.device) < k.slot_dropout
            key_logits = key_logits.masked_fill(drop & ~drop.all(dim=-1, keepdim=True),
                                                float("-inf"))
        refine = self._refine_step(layer_cache, k, w) if w.gate is not None else None
        # q unscaled: w.gamma carries the scale
        o, _, _, layer_cache.scan = asa_attend_step(
            logits, v, q, key_logits, 0.0 if w.gamma is None else w.gamma, k.read_temperature,
            refine, layer_cache.scan, w.gate)
        o = o.view(b, 1, h * d)
        return _project(self.o_proj, o if o.dtype == hidden.dtype else o.to(hidden.dtype))

    def _refine_step(self, layer_cache: ASMCacheLayer, k: _StepConstants,
                     w: _StepWeights) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`_refine` for one position (``r [B, H, 1, K]``) on the decode step of the
        slot-space linear attention."""

        def refine(r: torch.Tensor) -> torch.Tensor:
            if w.slot_qkv is not None:
                if r.dtype != w.slot_qkv.dtype:
                    r = r.to(w.slot_qkv.dtype)
                q_s, k_s, v_s = F.linear(r, w.slot_qkv).chunk(3, dim=-1)  # [B, H, 1, M]
            else:
                u = self.slot_in(r.to(self.slot_in.weight.dtype))
                q_s, k_s, v_s = self.slot_q(u), self.slot_k(u), self.slot_v(u)
            if k.slot_rotary is not None:
                q_s, k_s = rotate(q_s, k.slot_rotary), rotate(k_s, k.slot_rotary)
            phi_k = F.elu(k_s) + 1.0
            if k.valid is not None:
                phi_k = phi_k * k.valid
            u2, layer_cache.slot_space = causal_linear_attention_step(
                F.elu(q_s) + 1.0, phi_k, v_s, layer_cache.slot_space)
            if u2.dtype != v_s.dtype:
                u2 = u2.to(v_s.dtype)
            if self.training:
                u2 = self.slot_space_dropout(u2)
            return torch.tanh(_project(self.slot_out, u2))

        return refine

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        layer_cache: ASMCacheLayer | None = None,
        output_stats: bool = False,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        step: _StepConstants | None = None,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, RefinementStats | None]:
        """``hidden [B, T, D]``, ``positions [B, T]`` (position ids), ``valid [B, T]`` (bool);
        ``rotary``: the write keys' :func:`_rotary_tables` at ``positions`` (computed here if
        not given). Given ``step`` (one position, from :class:`ASMModel`) with a cache, no
        statistics and no intervention, this is the decode step :meth:`_step` unless the Triton
        backend is chosen; otherwise the chunk form. ``backend``: the resolved
        ``config.scan_backend`` (:class:`ASMModel` resolves it once per pass; None: here)."""
        c = self.config
        b, t, _ = hidden.shape
        if backend is None:
            backend = resolve_backend(c.scan_backend, positions, positions.shape[1])
        if (step is not None and step.backend == "torch" and layer_cache is not None
                and not output_stats and self._plain):
            return self._step(hidden, layer_cache, step), None
        h, d, k = self.num_heads, self.head_dim, self.num_slots
        q, key, v = self._qkv(hidden)
        if c.write_key_position == "rotary" and rotary is None:
            rotary = _rotary_tables(positions, d, c.rope_theta)
        scale = d ** -0.5
        recency = None
        if c.use_recency_bias:
            recency = F.softplus(self.recency_strength_raw) * self._alibi_slopes(
                hidden.device, torch.promote_types(hidden.dtype, torch.float32))
        logits, key_logits = slot_addressing(
            key, q, self.slot_keys, rotary if c.write_key_position == "rotary" else None,
            positions, valid, recency, scale / c.write_temperature, scale, backend)
        if self.training and c.slot_dropout > 0:
            drop = torch.rand(b, h, 1, k, device=hidden.device) < c.slot_dropout
            drop = drop & ~drop.all(dim=-1, keepdim=True)
            key_logits = key_logits.masked_fill(drop, float("-inf"))
        gamma = self.gamma if c.use_content_read else 0.0
        refine = None
        if c.use_slot_space_refinement:
            refine = self._refine(positions, valid, layer_cache, backend)
        par, orth = self.intervention
        gated_read = refine is not None and not output_stats and all(
            x == 1.0 for x in par + orth)
        gate = self.gate if refine is not None else None
        state = layer_cache.scan if layer_cache is not None else None
        # the content term gamma <q scale, slot> with the scale on gamma: one pass less over q
        o, r, delta, new_state = asa_attend(
            logits, v, q, key_logits, gamma * scale, c.read_temperature, refine, c.chunk_size,
            state, backend, gate=gate if gated_read else None)
        if layer_cache is not None:
            layer_cache.scan = new_state
        stats = None
        if delta is not None:
            gd = gate.to(delta.dtype) * delta
            o_sq = (o * o).sum(-1, keepdim=True)
            alpha = (gd * o).sum(-1, keepdim=True) * torch.where(
                o_sq > 0, 1.0 / torch.where(o_sq > 0, o_sq, torch.ones_like(o_sq)), 0.0)
            parallel = alpha * o
            orthogonal = gd - parallel
            cp = torch.tensor(par, device=o.device, dtype=o.dtype)[None, :, None, None]
            co = torch.tensor(orth, device=o.device, dtype=o.dtype)[None, :, None, None]
            out = o + cp * parallel + co * orthogonal
            if output_stats:
                stats = self._stats(alpha, orthogonal, gd, o, r, logits, valid)
        else:
            out = o
        out = out.to(hidden.dtype).transpose(1, 2).reshape(b, t, h * d)
        return self.o_proj(out), stats

    def _stats(self, alpha: torch.Tensor, orthogonal: torch.Tensor, gd: torch.Tensor,
               o: torch.Tensor, r: torch.Tensor, logits: torch.Tensor,
               valid: torch.Tensor) -> RefinementStats:
        with torch.no_grad():
            gd_norm = gd.norm(dim=-1)
            o_norm = o.norm(dim=-1)
            orth_frac = orthogonal.norm(dim=-1) / gd_norm.clamp_min(torch.finfo(gd.dtype).tiny)
            rel = gd_norm / o_norm.clamp_min(torch.finfo(o.dtype).tiny)
            # Write mass of each real token in each slot at the last position, newest first.
            weights = torch.softmax(logits.flip(2).masked_fill(
                ~valid.flip(1)[:, None, :, None], float("-inf")), dim=2).nan_to_num(0.0)
            reached = weights.cumsum(dim=2) >= 0.5
            newest_first_valid = valid.flip(1)[:, None, :, None]
            count_before = (newest_first_valid.cumsum(dim=2) * reached).masked_fill(
                ~reached, torch.iinfo(torch.long).max)
            half_life = count_before.amin(dim=2)
            half_life = torch.where(reached.any(dim=2), half_life, torch.zeros_like(half_life))
            ess = 1.0 / (r * r).sum(-1)
            overlap = torch.minimum(r[:, :, 1:], r[:, :, :-1]).sum(-1)  # [B, H, T-1]
            pair = (valid[:, 1:] & valid[:, :-1])[:, None, :].to(r.dtype)
            inertia = (overlap * pair).sum(-1) / pair.sum(-1).clamp_min(1.0)
            return RefinementStats(
                alpha=alpha.squeeze(-1), orthogonal_fraction=orth_frac, relative_magnitude=rel,
                slot_write_half_life=half_life, slot_ess=ess, routing_inertia=inertia,
                gate=self.gate.detach(), mask=valid)


class ASMMLP(nn.Module):
    """``down(gelu(up(x)))``."""

    def __init__(self, config: ASMConfig) -> None:
        super().__init__()
        width = int(config.hidden_size * config.mlp_ratio)
        self.up_proj = nn.Linear(config.hidden_size, width)
        self.down_proj = nn.Linear(width, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(hidden)))


class ASMBlock(nn.Module):
    """Pre-LayerNorm residual block: ``x + ASA(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, config: ASMConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ASAAttention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size,
                                                     eps=config.layer_norm_eps)
        self.mlp = ASMMLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                layer_cache: ASMCacheLayer | None, output_stats: bool,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                step: _StepConstants | None = None, backend: str | None = None,
                ) -> tuple[torch.Tensor, RefinementStats | None]:
        attn, stats = self.self_attn(self.input_layernorm(hidden), positions, valid, layer_cache,
                                     output_stats, rotary, step, backend)
        if self.training:  # dropout is the identity in eval: skip its call on the decode path
            attn = self.dropout(attn)
        hidden = hidden + attn
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + (self.dropout(mlp) if self.training else mlp), stats


@dataclass
class ASMModelOutput(ModelOutput):
    """Outputs of :class:`ASMModel`.

    Attributes:
        last_hidden_state: ``[B, T, D]`` after the final LayerNorm.
        cache: the :class:`ASMCache` (when ``use_cache``), under the installed transformers'
            name (:data:`CACHE_NAME`: ``cache`` from 5.24, ``past_key_values`` before).
        hidden_states: residual stream after the embeddings and after every block.
        refinement_stats: one :class:`RefinementStats` per layer (when asked).
    """

    last_hidden_state: torch.Tensor | None = None
    if CACHE_NAME == "cache":
        cache: ASMCache | None = None
    else:
        past_key_values: ASMCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    refinement_stats: tuple[RefinementStats, ...] | None = None


@dataclass
class ASMCausalLMOutput(ModelOutput):
    """Outputs of :class:`ASMForCausalLM`: ``loss`` (next-token cross-entropy), ``logits``
    ``[B, T, V]`` and the fields of :class:`ASMModelOutput`."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    if CACHE_NAME == "cache":
        cache: ASMCache | None = None
    else:
        past_key_values: ASMCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    refinement_stats: tuple[RefinementStats, ...] | None = None


class ASMPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the refinement-intervention API shared by the ASM models."""

    config_class = ASMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["ASMBlock"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, ASAAttention):
            module.reset_parameters()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _attention_layers(self) -> list[ASAAttention]:
        return [m for m in self.modules() if isinstance(m, ASAAttention)]

    def set_refinement_intervention(
        self,
        mode: str = "default",
        beta: float = 1.0,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
    ) -> None:
        """Rescale the parts of the refinement ``g Delta`` parallel / orthogonal to ``o``.

        Modes (coefficients of the parallel and orthogonal parts): ``default`` (1, 1),
        ``parallel_only`` (1, 0), ``orthogonal_only`` (0, 1), ``orthogonal_scaled`` (1, beta),
        ``parallel_scaled`` (beta, 1), ``none`` (0, 0). Applied to the given layers and heads
        (default: all); others keep their setting. Weights are untouched.
        """
        coefficients = {"default": (1.0, 1.0), "parallel_only": (1.0, 0.0),
                        "orthogonal_only": (0.0, 1.0), "orthogonal_scaled": (1.0, beta),
                        "parallel_scaled": (beta, 1.0), "none": (0.0, 0.0)}
        if mode not in coefficients:
            raise ValueError(f"mode must be one of {INTERVENTION_MODES}, got {mode!r}")
        attention = self._attention_layers()
        n_layers, n_heads = len(attention), self.config.num_attention_heads
        layers = list(range(n_layers)) if layers is None else list(layers)
        heads = list(range(n_heads)) if heads is None else list(heads)
        if any(not 0 <= i < n_layers for i in layers):
            raise ValueError(f"layers must be in [0, {n_layers}), got {layers}")
        if any(not 0 <= i < n_heads for i in heads):
            raise ValueError(f"heads must be in [0, {n_heads}), got {heads}")
        cp, co = coefficients[mode]
        for i in layers:
            par, orth = (list(x) for x in attention[i].intervention)
            for j in heads:
                par[j], orth[j] = cp, co
            attention[i].set_intervention(par, orth)

    @contextmanager
    def refinement_intervention(self, mode: str = "default", beta: float = 1.0,
                                layers: Sequence[int] | None = None,
                                heads: Sequence[int] | None = None) -> Iterator[None]:
        """Context manager around :meth:`set_refinement_intervention`; restores the previous
        setting on exit, also on exceptions."""
        saved = [layer.intervention for layer in self._attention_layers()]
        try:
            self.set_refinement_intervention(mode, beta, layers, heads)
            yield
        finally:
            for layer, setting in zip(self._attention_layers(), saved, strict=True):
                layer.set_intervention(*setting)


class ASMModel(ASMPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` ASA blocks, final LayerNorm: ``input_ids [B, T]`` ->
    ``last_hidden_state [B, T, D]``. Positions come from ``attention_mask`` (real tokens count
    from 0 in each row), so left padding leaves the real tokens' outputs unchanged."""

    def __init__(self, config: ASMConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(ASMBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: ASMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool = False,
        output_refinement_stats: bool = False,
        return_dict: bool | None = None,
        past_key_values: ASMCache | None = None,
        **kwargs,
    ) -> ASMModelOutput | tuple:
        """``attention_mask [B, T_past + T]`` or ``[B, T]`` (1 = real token); ``position_ids``
        are derived from it and ignored if given. The decode state comes as ``cache`` (or by
        its pre-5.24 name ``past_key_values``)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = hidden.shape[:2]
        if use_cache is None:
            use_cache = self.config.use_cache
        cache = _one_cache(cache, past_key_values)
        if use_cache and cache is None:
            cache = ASMCache(self.config)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a [batch, length] padding mask, got shape "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=hidden.device)
        else:
            valid = attention_mask[:, -t:].to(device=hidden.device, dtype=torch.bool)
        start = torch.zeros(b, dtype=torch.long, device=hidden.device)
        if cache is not None and cache.next_position is not None:
            start = cache.next_position
        positions = (start[:, None] + valid.long().cumsum(dim=1) - 1).clamp_min(0)
        hidden = self.dropout(hidden)
        rotary = None
        if self.config.write_key_position == "rotary":
            rotary = _rotary_tables(positions, self.config.head_dim, self.config.rope_theta)
        backend = resolve_backend(self.config.scan_backend, positions, t)  # once for every layer
        step = None
        if t == 1 and cache is not None:
            step = _StepConstants.build(self.config, positions, valid, rotary, hidden.dtype,
                                        backend)
        states: list[torch.Tensor] = [hidden]
        stats: list[RefinementStats] = []
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            hidden, layer_stats = layer(hidden, positions, valid, layer_cache,
                                        output_refinement_stats, rotary, step, backend)
            states.append(hidden)
            if layer_stats is not None:
                stats.append(layer_stats)
        hidden = self.norm(hidden)
        if cache is not None:
            cache.seen_tokens += t
            cache.next_position = start + valid.long().sum(dim=1)
        output = ASMModelOutput(
            last_hidden_state=hidden,
            hidden_states=tuple(states) if output_hidden_states else None,
            refinement_stats=tuple(stats) if output_refinement_stats else None,
            **{CACHE_NAME: cache if use_cache else None},
        )
        return output if return_dict is not False else output.to_tuple()


class ASMForCausalLM(ASMPreTrainedModel, GenerationMixin):
    """ASM language model: :class:`ASMModel` and a (tied by default) output projection."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ASMConfig) -> None:
        super().__init__(config)
        self.model = ASMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: ASMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool = False,
        output_refinement_stats: bool = False,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        past_key_values: ASMCache | None = None,
        **kwargs,
    ) -> ASMCausalLMOutput | tuple:
        """``labels [B, T]`` (``-100`` ignored) give the shifted next-token loss; with
        ``logits_to_keep = k > 0`` only the last ``k`` positions are projected. The decode state
        comes as ``cache`` (or by its pre-5.24 name ``past_key_values``)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         cache=_one_cache(cache, past_key_values), inputs_embeds=inputs_embeds,
                         use_cache=use_cache, output_hidden_states=output_hidden_states,
                         output_refinement_stats=output_refinement_stats)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            # shift the labels, not the logits: slicing [B, T, V] logits would copy them (and
            # fill a zero tensor of their size in the backward)
            shift_labels = F.pad(labels.to(logits.device), (0, 1), value=-100)[:, 1:]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   shift_labels.reshape(-1), ignore_index=-100)
        output = ASMCausalLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                   refinement_stats=out.refinement_stats,
                                   **{CACHE_NAME: getattr(out, CACHE_NAME)})
        return output if return_dict is not False else output.to_tuple()


ASMConfig.register_for_auto_class()
ASMModel.register_for_auto_class("AutoModel")
ASMForCausalLM.register_for_auto_class("AutoModelForCausalLM")
