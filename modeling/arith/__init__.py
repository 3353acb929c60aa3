"""ArithTransformer: variable binding + modular addition (see README.md beside this file)."""

from __future__ import annotations

from .configuration_arith import ArithConfig
from .data_arith import (
    CURATED_POOLS,
    POOLS,
    SPLITS,
    ArithTask,
    PoolSpec,
    arith_dataset,
    decode,
    sample_batch,
)
from .modeling_arith import ArithOutput, ArithTransformer
from .progress_arith import fourier_analysis, ov2_mlp2_logits, progress_measures, qk_scores
from .training_arith import TrainConfig, evaluate_pools, make_pools, train_arith

__all__ = [
    "CURATED_POOLS",
    "POOLS",
    "SPLITS",
    "ArithConfig",
    "ArithOutput",
    "ArithTask",
    "ArithTransformer",
    "PoolSpec",
    "TrainConfig",
    "arith_dataset",
    "decode",
    "evaluate_pools",
    "fourier_analysis",
    "make_pools",
    "ov2_mlp2_logits",
    "progress_measures",
    "qk_scores",
    "sample_batch",
    "train_arith",
]
