"""Configuration of the ArithTransformer (variable binding + modular addition).

The vocabulary is laid out as ``[0 .. modulus-1]`` the numbers, then ``+``, ``=``, ``PAD`` and
the ``num_variables`` variable names (``a``, ``b``, ...). The unembedding covers the numbers only.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

__all__ = ["ArithConfig"]


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ArithConfig.{name} must be an integer >= {minimum}, got {value!r}")


class ArithConfig(PretrainedConfig):
    """Sizes of the paper's 2-layer, 1-head, attention-only-then-MLP transformer.

    Args:
        modulus: ``N``, the number tokens ``0 .. N-1`` and the output classes (default 59).
        num_variables: ``V``, the variable tokens (default 12, ``a`` .. ``l``).
        vocab_size: ``N + 3 + V`` (numbers, ``+``, ``=``, ``PAD``, variables); derived when None.
        hidden_size: ``d_model`` (128).
        num_hidden_layers: attention layers (2).
        num_attention_heads: heads per layer (1).
        head_dim: ``d_head`` (128).
        intermediate_size: ``d_mlp`` (512).
        mlp_layers: indices of the layers that have an MLP after attention; default: the last
            layer only (the paper removes the layer-1 MLP).
        hidden_act: MLP activation, ``"relu"`` or ``"gelu"``.
        max_position_embeddings: ``T``, learned absolute positions (16).
        initializer_range: std of the normal initialisation; default ``0.8 / sqrt(d_model)``
            (TransformerLens, which the paper used).
    """

    model_type = "arith"

    def __init__(
        self,
        modulus: int = 59,
        num_variables: int = 12,
        vocab_size: int | None = None,
        hidden_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 1,
        head_dim: int = 128,
        intermediate_size: int = 512,
        mlp_layers: list[int] | None = None,
        hidden_act: str = "relu",
        max_position_embeddings: int = 16,
        initializer_range: float | None = None,
        **kwargs: Any,
    ) -> None:
        _check_int("modulus", modulus, 2)
        _check_int("num_variables", num_variables, 1)
        expected_vocab = modulus + 3 + num_variables
        if vocab_size is None:
            vocab_size = expected_vocab
        if vocab_size != expected_vocab:
            raise ValueError(
                f"ArithConfig.vocab_size must be modulus + 3 + num_variables = {expected_vocab}, "
                f"got {vocab_size!r}"
            )
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_hidden_layers", num_hidden_layers),
            ("num_attention_heads", num_attention_heads),
            ("head_dim", head_dim),
            ("intermediate_size", intermediate_size),
            ("max_position_embeddings", max_position_embeddings),
        ):
            _check_int(name, value, 1)
        if mlp_layers is None:
            mlp_layers = [num_hidden_layers - 1]
        mlp_layers = list(mlp_layers)
        if any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_hidden_layers
            for i in mlp_layers
        ) or len(set(mlp_layers)) != len(mlp_layers):
            raise ValueError(
                "ArithConfig.mlp_layers must be distinct layer indices in "
                f"[0, {num_hidden_layers}), got {mlp_layers!r}"
            )
        if hidden_act not in ("relu", "gelu"):
            raise ValueError(f"ArithConfig.hidden_act must be 'relu' or 'gelu', got {hidden_act!r}")
        if initializer_range is None:
            initializer_range = 0.8 / math.sqrt(hidden_size)
        if not isinstance(initializer_range, (int, float)) or not initializer_range > 0:
            raise ValueError(
                "ArithConfig.initializer_range must be a positive number, "
                f"got {initializer_range!r}"
            )
        self.modulus = modulus
        self.num_variables = num_variables
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.mlp_layers = sorted(mlp_layers)
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = float(initializer_range)
        kwargs.setdefault("pad_token_id", modulus + 2)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @property
    def plus_token_id(self) -> int:
        return self.modulus

    @property
    def equals_token_id(self) -> int:
        return self.modulus + 1

    @property
    def variable_token_ids(self) -> list[int]:
        return list(range(self.modulus + 3, self.modulus + 3 + self.num_variables))
