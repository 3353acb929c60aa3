"""Configuration of the AIRSolver (Asymmetric Input Recurrence, and the paper's controls).

Every variant of *One Model, Two Roles* is a config value: the injection counts (``injection``),
level tokens (``level_token``), operator forms (``input_operator``), the single-state ablation
(``single_state``) and the two-network HRM-style baseline (``share_weights=False``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from transformers import PretrainedConfig

__all__ = ["INJECTION_VARIANTS", "INPUT_OPERATORS", "LEVEL_TOKENS", "AIRConfig", "parse_injection"]

INJECTION_VARIANTS = ("L_Hx", "Lx_H", "L_H2x", "L2x_H", "Lx_H2x", "L2x_Hx", "Lx_Hx", "L2x_H2x")
LEVEL_TOKENS = (None, "addition", "prepend_strip", "prepend_no_strip")
INPUT_OPERATORS = ("add", "linear", "nonlinear", "sign_flip", "hadamard")
LOSS_TYPES = ("stablemax", "softmax")

_INJECTION = re.compile(r"^L(?:(\d*)x)?_H(?:(\d*)x)?$")


def parse_injection(name: str) -> tuple[int, int]:
    """``"L2x_Hx"`` → ``(2, 1)``: how many copies of the encoded input the L- and H-updates get."""
    match = _INJECTION.match(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(
            f"AIRConfig.injection must look like 'L<n>x_H<m>x' (e.g. one of {INJECTION_VARIANTS}), "
            f"got {name!r}"
        )
    counts = []
    for group, text in zip(match.groups(), name.split("_"), strict=True):
        counts.append(0 if "x" not in text else int(group or 1))
    return counts[0], counts[1]


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"AIRConfig.{name} must be an integer >= {minimum}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"AIRConfig.{name} must be one of {choices}, got {value!r}")


def _find_multiple(value: float, multiple: int) -> int:
    return int(-(-round(value) // multiple) * multiple)


class AIRConfig(PretrainedConfig):
    """Sizes and variant switches of the shared recurrent solver (defaults: the paper's Sudoku run).

    Args:
        vocab_size: input/output tokens (11 for 9×9 Sudoku: PAD, BLANK, digits 1–9).
        seq_len: cells per puzzle (81 for 9×9 Sudoku, 900 for a 30×30 maze).
        hidden_size, num_hidden_layers, num_attention_heads: the shared block (512, 4, 8).
        expansion: SwiGLU expansion; ``intermediate_size`` defaults to ``2/3 · expansion ·
            hidden_size`` rounded up to a multiple of 256 (the authors' code: 1536 at d 512).
        rope_theta, rms_norm_eps: RoPE base and the post-norm RMSNorm epsilon.
        H_cycles, L_cycles: the sub-step pattern ``(L × L_cycles, H) × H_cycles`` per segment.
        injection: copies of the encoded input ``x`` per update type, ``"Lx_H"`` (default),
            ``"L_Hx"``, ``"L2x_H2x"``, ... (see :data:`INJECTION_VARIANTS`).
        level_token: ``None``, ``"addition"`` (a learned vector per update type added to every
            position), ``"prepend_strip"`` (a learned token prepended to the block input and
            stripped from its output) or ``"prepend_no_strip"`` (the token lives at position 0 of
            each state and is never stripped).
        input_operator: how ``x`` enters an injecting update: ``"add"`` (``n·x``), ``"linear"``
            (``n·Wx``), ``"nonlinear"`` (``n·tanh(Wx)``), ``"sign_flip"`` (``−n·x``) or
            ``"hadamard"`` (``z_self + (z_other + z_self) ⊙ (n·x)``); the authors' code for each
            (the paper does not give the formulas).
        single_state: one state updated by the same L,L,H pattern (appendix D ablation).
        share_weights: one block for both updates (AIR/TRM); ``False`` gives HRM's two networks.
        full_backprop: backpropagate through every sub-step of the segment instead of only the
            last L- and H-update (the one-step gradient).
        num_puzzle_identifiers, puzzle_emb_len: the learned puzzle/prefix embedding (one
            identifier and one prefix position for Sudoku and Maze; 0 positions disables it).
        halt_max_steps, halt_exploration_prob: ACT segments (16) and exploration (0.1).
        loss_type: ``"stablemax"`` (the paper) or ``"softmax"`` cross-entropy.
        initial_state_std: std of the fixed truncated-normal initial states (±2 std,
            variance-corrected so the drawn values have this std).
    """

    model_type = "air"

    def __init__(
        self,
        vocab_size: int = 11,
        seq_len: int = 81,
        hidden_size: int = 512,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 8,
        expansion: float = 4.0,
        intermediate_size: int | None = None,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        H_cycles: int = 2,
        L_cycles: int = 2,
        injection: str = "Lx_H",
        level_token: str | None = None,
        input_operator: str = "add",
        single_state: bool = False,
        share_weights: bool = True,
        full_backprop: bool = False,
        num_puzzle_identifiers: int = 1,
        puzzle_emb_len: int = 1,
        halt_max_steps: int = 16,
        halt_exploration_prob: float = 0.1,
        loss_type: str = "stablemax",
        initial_state_std: float = 1.0,
        **kwargs: Any,
    ) -> None:
        for name, value, minimum in (
            ("vocab_size", vocab_size, 2),
            ("seq_len", seq_len, 1),
            ("hidden_size", hidden_size, 1),
            ("num_hidden_layers", num_hidden_layers, 1),
            ("num_attention_heads", num_attention_heads, 1),
            ("H_cycles", H_cycles, 1),
            ("L_cycles", L_cycles, 1),
            ("num_puzzle_identifiers", num_puzzle_identifiers, 1),
            ("puzzle_emb_len", puzzle_emb_len, 0),
            ("halt_max_steps", halt_max_steps, 1),
        ):
            _check_int(name, value, minimum)
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise ValueError(
                f"AIRConfig.hidden_size ({hidden_size}) must split into num_attention_heads "
                f"({num_attention_heads}) heads of even size (RoPE rotates pairs)"
            )
        if intermediate_size is None:
            intermediate_size = _find_multiple(expansion * hidden_size * 2 / 3, 256)
        _check_int("intermediate_size", intermediate_size, 1)
        parse_injection(injection)
        _check_choice("level_token", level_token, LEVEL_TOKENS)
        _check_choice("input_operator", input_operator, INPUT_OPERATORS)
        _check_choice("loss_type", loss_type, LOSS_TYPES)
        for name, value in (("single_state", single_state), ("share_weights", share_weights),
                            ("full_backprop", full_backprop)):
            if not isinstance(value, bool):
                raise ValueError(f"AIRConfig.{name} must be a bool, got {value!r}")
        if single_state and (level_token is not None or not share_weights):
            raise ValueError(
                "AIRConfig.single_state is the appendix-D ablation of the default model: it takes "
                "no level_token and needs share_weights=True"
            )
        if not 0.0 <= float(halt_exploration_prob) <= 1.0:
            raise ValueError(
                f"AIRConfig.halt_exploration_prob must lie in [0, 1], got {halt_exploration_prob!r}"
            )
        for name, value in (("rope_theta", rope_theta), ("rms_norm_eps", rms_norm_eps),
                            ("initial_state_std", initial_state_std), ("expansion", expansion)):
            if not float(value) > 0:
                raise ValueError(f"AIRConfig.{name} must be > 0, got {value!r}")

        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.expansion = float(expansion)
        self.intermediate_size = intermediate_size
        self.rope_theta = float(rope_theta)
        self.rms_norm_eps = float(rms_norm_eps)
        self.H_cycles = H_cycles
        self.L_cycles = L_cycles
        self.injection = injection
        self.level_token = level_token
        self.input_operator = input_operator
        self.single_state = single_state
        self.share_weights = share_weights
        self.full_backprop = full_backprop
        self.num_puzzle_identifiers = num_puzzle_identifiers
        self.puzzle_emb_len = puzzle_emb_len
        self.halt_max_steps = halt_max_steps
        self.halt_exploration_prob = float(halt_exploration_prob)
        self.loss_type = loss_type
        self.initial_state_std = float(initial_state_std)
        super().__init__(**kwargs)

    @property
    def injection_counts(self) -> tuple[int, int]:
        """``(n_L, n_H)``: copies of ``x`` in the L- and H-update inputs."""
        return parse_injection(self.injection)

    @property
    def board_size(self) -> int:
        """Side of the square board the ``seq_len`` cells form."""
        side = math.isqrt(self.seq_len)
        if side * side != self.seq_len:
            raise ValueError(f"AIRConfig.seq_len {self.seq_len} is not a square board")
        return side

    @property
    def sub_steps(self) -> tuple[str, ...]:
        """The segment's update order, e.g. ``("L", "L", "H", "L", "L", "H")``."""
        return (("L",) * self.L_cycles + ("H",)) * self.H_cycles
