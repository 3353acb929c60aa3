"""Model fingerprints: what a bank or selector must match before it may touch a model."""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch import nn

from hf_memory.models.adapters import get_adapter, head_dim

__all__ = ["FingerprintMismatchError", "check_fingerprint", "compare_fingerprints",
           "fingerprint_of", "model_fingerprint", "weights_digest"]


class FingerprintMismatchError(ValueError):
    """An artifact was made on a different model than the one it is applied to."""


def weights_digest(key_weights: list[torch.Tensor]) -> str:
    """sha256 of the first and last layer's key projection weights, rounded to bfloat16.

    Rounding makes the digest survive a float32 → bfloat16 cast of the same checkpoint while
    still telling two checkpoints of one architecture apart. Serving engines that fuse the
    projections (vLLM's ``qkv_proj``) pass the key rows of the fused weight.
    """
    digest = hashlib.sha256()
    for weight in key_weights:
        digest.update(weight.detach().to(torch.bfloat16).contiguous().cpu()
                      .view(torch.uint16).numpy())
    return digest.hexdigest()[:16]


def _weights_digest(model: nn.Module) -> str:
    adapter = get_adapter(model)
    last = len(adapter.layers(model)) - 1
    return weights_digest([adapter.key_weight(model, index) for index in sorted({0, last})])


def fingerprint_of(config, *, dtype: str, digest: str) -> dict[str, Any]:
    """The fingerprint of a model given its config, parameter dtype and :func:`weights_digest`."""
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "model_type": config.model_type,
        "name_or_path": getattr(config, "name_or_path", "") or "",
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": head_dim(config),
        "hidden_size": config.hidden_size,
        "rope_parameters": {k: rope[k] for k in sorted(rope)},
        "dtype": dtype.removeprefix("torch."),
        "weights_digest": digest,
    }


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Architecture facts and a weight digest: ``model_type``, name, sizes, rope, dtype."""
    return fingerprint_of(model.config, dtype=str(next(model.parameters()).dtype),
                          digest=_weights_digest(model))


def compare_fingerprints(expected: dict[str, Any], actual: dict[str, Any], what: str, *,
                         ignore: tuple[str, ...] = ()) -> None:
    """Raise if ``actual`` differs from ``expected`` in anything but dtype (which only warns)
    and the ``ignore``d keys. The name is compared only where the weight digests are missing or
    differ: a local copy of the same checkpoint (a path where the artifact recorded a Hub id, as
    lm-eval's ``pretrained=DIR`` loads it) is the same model."""
    skipped = {"dtype", *ignore}
    if expected.get("weights_digest") and expected["weights_digest"] == actual.get(
            "weights_digest"):
        skipped.add("name_or_path")
    differing = sorted(k for k in expected if k not in skipped and expected[k] != actual.get(k))
    if differing:
        details = "; ".join(f"{k}: artifact {expected[k]!r}, model {actual.get(k)!r}"
                            for k in differing)
        raise FingerprintMismatchError(f"{what} was made for a different model ({details})")
    if expected.get("dtype") != actual.get("dtype"):
        warnings.warn(f"{what} was made in {expected.get('dtype')}, the model runs in "
                      f"{actual.get('dtype')}; steering computes in float32 either way",
                      stacklevel=3)


def check_fingerprint(expected: dict[str, Any], model: nn.Module, what: str) -> None:
    """Raise if ``model`` differs from ``expected`` in anything but dtype (which only warns)."""
    compare_fingerprints(expected, model_fingerprint(model), what)
