"""The authors' checkpoints: HRM-style state dicts of the AIR code → :class:`AIRSolver`.

The authors' training saves the state dict of an ACT wrapper (keys under ``model.inner.``, with a
``_orig_mod.`` prefix when the model was compiled). Their parameter names are HRM's, which ours
follow: ``embed_tokens.embedding_weight``, ``puzzle_emb.weights`` (``[ids, puzzle_emb_ndim]``,
zero-padded to whole positions), ``lm_head``, ``q_head``, ``H_init`` / ``L_init``, the shared
network ``f_level.layers.{i}.self_attn.qkv_proj`` / ``o_proj`` / ``mlp.gate_up_proj`` /
``mlp.down_proj`` (HRM: ``H_level`` and ``L_level``), ``g_input`` for the linear and nonlinear
operators and ``input_token_L`` / ``input_token_H`` for the additive level token. The variant
comes from their architecture name (``air.air_1net_L2x_H@AIR``, ``hrm...``) in the config.
Their prepend level-token runs and learned positions are not converted (refused by name).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from .configuration_air import INJECTION_VARIANTS, AIRConfig
from .modeling_air import AIRSolver

__all__ = ["AuthorsCheckpointError", "config_from_authors", "from_authors_state_dict"]

_OPERATORS = {"gx_linear": "linear", "gx_non_linear": "nonlinear", "had_prod": "hadamard",
              "minus_x": "sign_flip"}
_LAYER = re.compile(r"(f_level|H_level|L_level)\.layers\.(\d+)\.(.+)$")


class AuthorsCheckpointError(ValueError):
    """The checkpoint or its config is not one :class:`AIRSolver` reproduces."""


def _variant(arch_name: str) -> dict[str, Any]:
    """``air.air_1net_L2x_H2x_input_token_addition@AIR`` → the matching AIRConfig switches."""
    module = arch_name.split("@")[0].split(".")[-1]
    if module.startswith("hrm"):
        return {"share_weights": False}
    match = re.fullmatch(r"air_1net_(.+)", module)
    if match is None:
        raise AuthorsCheckpointError(f"unknown architecture {arch_name!r}: expected "
                                     "air.air_1net_<variant>@AIR or an HRM name")
    rest = match.group(1)
    if rest in _OPERATORS:
        return {"input_operator": _OPERATORS[rest]}
    injection, _, token = rest.partition("_input_token_")
    if injection not in INJECTION_VARIANTS:
        raise AuthorsCheckpointError(f"unknown AIR variant {rest!r} in {arch_name!r}")
    if token and token != "addition":
        raise AuthorsCheckpointError(
            f"level token {token!r} ({arch_name}) is not converted: only the additive level "
            "token's parameters are mapped so far")
    return {"injection": injection, **({"level_token": "addition"} if token else {})}


def config_from_authors(arch: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                        seq_len: int | None = None) -> AIRConfig:
    """An :class:`AIRConfig` from their ``arch`` config (the yaml's keys, or the whole
    ``all_config.yaml`` with an ``arch`` section) and the shapes in the state dict."""
    arch = dict(arch.get("arch", arch))
    if arch.get("pos_encodings", "rope") != "rope":
        raise AuthorsCheckpointError(f"pos_encodings {arch['pos_encodings']!r}: AIRSolver uses "
                                     "RoPE only")
    if "name" not in arch:
        raise AuthorsCheckpointError("the config names no architecture (arch.name)")
    seq_len = seq_len or arch.get("seq_len")
    if seq_len is None:
        raise AuthorsCheckpointError("the puzzle length is not in the config: pass seq_len "
                                     "(81 for 9x9 Sudoku, 900 for 30x30 mazes)")
    variant = _variant(str(arch["name"]))
    embed = state["embed_tokens.embedding_weight"]
    hidden = embed.shape[1]
    if int(arch.get("hidden_size", hidden)) != hidden:
        raise AuthorsCheckpointError(f"hidden_size {arch['hidden_size']} in the config, "
                                     f"{hidden} in the weights")
    prefix = "f_level" if variant.get("share_weights", True) else "L_level"
    depth = len({k.split(".")[2] for k in state if k.startswith(f"{prefix}.layers.")})
    puzzle = state.get("puzzle_emb.weights")
    try:
        return AIRConfig(
            vocab_size=embed.shape[0], seq_len=int(seq_len), hidden_size=hidden,
            num_hidden_layers=depth, num_attention_heads=int(arch["num_heads"]),
            expansion=float(arch.get("expansion", 4)),
            intermediate_size=state[f"{prefix}.layers.0.mlp.down_proj.weight"].shape[1],
            rope_theta=float(arch.get("rope_theta", 10000.0)),
            rms_norm_eps=float(arch.get("rms_norm_eps", 1e-5)),
            H_cycles=int(arch["H_cycles"]), L_cycles=int(arch["L_cycles"]),
            num_puzzle_identifiers=puzzle.shape[0] if puzzle is not None else 1,
            puzzle_emb_len=math.ceil(puzzle.shape[1] / hidden) if puzzle is not None else 0,
            halt_max_steps=int(arch.get("halt_max_steps", 16)),
            halt_exploration_prob=float(arch.get("halt_exploration_prob", 0.1)), **variant)
    except KeyError as error:
        raise AuthorsCheckpointError(f"the config or checkpoint lacks {error}") from None
    except ValueError as error:
        raise AuthorsCheckpointError(f"not a valid AIRConfig: {error}") from None


def _strip(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for prefix in ("_orig_mod.", "model.", "inner."):
            key = key.removeprefix(prefix)
        out[key] = value
    return out


def from_authors_state_dict(state: Mapping[str, torch.Tensor], arch: Mapping[str, Any],
                            seq_len: int | None = None) -> AIRSolver:
    """An :class:`AIRSolver` holding exactly the authors' weights (see the module docstring)."""
    state = _strip(state)
    if "embed_tokens.embedding_weight" not in state:
        raise AuthorsCheckpointError("not an AIR/HRM checkpoint: no embed_tokens.embedding_weight")
    config = config_from_authors(arch, state, seq_len)
    model = AIRSolver(config)
    d = config.hidden_size
    ours: dict[str, torch.Tensor] = {
        "embed_tokens.weight": state.pop("embed_tokens.embedding_weight"),
        "lm_head.weight": state.pop("lm_head.weight", None),
        "q_head.weight": state.pop("q_head.weight", None),
        "q_head.bias": state.pop("q_head.bias", None),
        "H_init": state.pop("H_init", None), "L_init": state.pop("L_init", None)}
    if config.puzzle_emb_len:
        weights = state.pop("puzzle_emb.weights")
        pad = config.puzzle_emb_len * d - weights.shape[1]
        ours["puzzle_emb.weight"] = torch.nn.functional.pad(weights, (0, pad))
    if "g_input.weight" in state:
        ours["input_proj.weight"] = state.pop("g_input.weight")
    if config.level_token == "addition":
        ours["level_emb"] = torch.stack((state.pop("input_token_L"), state.pop("input_token_H")))
    blocks = {"f_level": "block", "L_level": "L_block", "H_level": "H_block"}
    for key in [k for k in state if _LAYER.match(k)]:
        level, index, rest = _LAYER.match(key).groups()
        ours[f"{blocks[level]}.layers.{index}.{rest}"] = state.pop(key)
    missing = sorted(k for k, v in ours.items() if v is None)
    leftover = sorted(state)
    if missing or leftover:
        raise AuthorsCheckpointError(
            f"checkpoint does not match the {config.injection}/{config.input_operator} "
            f"variant: missing {missing[:4]}, unexpected {leftover[:4]}")
    expected = model.state_dict()
    wrong = sorted(k for k in expected if k not in ours or ours[k].shape != expected[k].shape)
    if wrong:
        raise AuthorsCheckpointError(f"weights missing or of the wrong shape: {wrong[:4]}")
    dtype = expected["embed_tokens.weight"].dtype
    model.load_state_dict({k: v.to(dtype) for k, v in ours.items()})
    return model.eval()
