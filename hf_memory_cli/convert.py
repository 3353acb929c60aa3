"""``hf-memory convert``: the papers' published checkpoints as ``save_pretrained`` folders."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import CLIError
from .types import positive_int

__all__ = ["add_convert_parser"]


def _read_config(path: str) -> dict:
    import yaml

    try:
        text = Path(path).read_text()
        record = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except OSError as error:
        raise CLIError(f"cannot read the config {path}: {error.strerror}") from error
    except (ValueError, yaml.YAMLError) as error:
        raise CLIError(f"{path} is not valid JSON/YAML: {str(error).splitlines()[0]}") from error
    if not isinstance(record, dict):
        raise CLIError(f"{path} holds no mapping of architecture settings")
    return record


def _load_state(path: str) -> dict:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CLIError(f"no checkpoint at {path}") from None
    except Exception as error:  # unpickling refused, or a corrupt file
        raise CLIError(f"{path} is not a tensors-only PyTorch state dict: "
                       f"{str(error).splitlines()[0]}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise CLIError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def _convert(args: argparse.Namespace) -> None:
    if args.family == "arith":
        from modeling.arith.convert_arith import CheckpointConversionError, from_transformer_lens

        state = _load_state(args.checkpoint)
        try:
            model = from_transformer_lens(state, num_variables=args.num_variables)
        except CheckpointConversionError as error:
            raise CLIError(str(error)) from error
        c = model.config
        summary = (f"ArithTransformer, {c.num_hidden_layers} layers, d {c.hidden_size}, "
                   f"{c.num_attention_heads} head(s), MLP after layers {c.mlp_layers}, "
                   f"N {c.modulus}, {c.num_variables} variables")
    else:
        from modeling.air.convert_air import AuthorsCheckpointError, from_authors_state_dict

        if args.config is None:
            raise CLIError("convert air needs --config (the authors' arch yaml or all_config)")
        arch = _read_config(args.config)
        state = _load_state(args.checkpoint)
        try:
            model = from_authors_state_dict(state, arch, seq_len=args.seq_len)
        except AuthorsCheckpointError as error:
            raise CLIError(str(error)) from error
        c = model.config
        summary = (f"AIRSolver {c.injection}, operator {c.input_operator}, level token "
                   f"{c.level_token}, shared {c.share_weights}, d {c.hidden_size}, "
                   f"{c.num_hidden_layers} layers, seq_len {c.seq_len}")
    try:
        model.save_pretrained(args.out)
    except OSError as error:
        raise CLIError(f"cannot write {args.out}: {error}") from error
    print(f"# {args.checkpoint} -> {args.out}: {summary}")


def add_convert_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``convert`` on the ``hf-memory`` parser."""
    convert = commands.add_parser(
        "convert", help="convert a paper's published checkpoint into a save_pretrained folder",
        description="arith: a TransformerLens state dict of Assign and Add. air: a state dict of "
                    "the AIR authors' code (HRM-style names; --config their arch yaml). Files "
                    "are read with torch.load(weights_only=True); the folder loads with "
                    "from_pretrained and AutoModel (trust_remote_code).")
    convert.add_argument("family", choices=("arith", "air"), help="which paper's checkpoint")
    convert.add_argument("checkpoint", metavar="CHECKPOINT", help="the authors' state dict file")
    convert.add_argument("out", metavar="OUT_DIR", help="where to write the model folder")
    convert.add_argument("--num-variables", type=positive_int, default=12, metavar="V",
                         help="arith: variable tokens in the vocabulary (default 12)")
    convert.add_argument("--config", metavar="FILE",
                         help="air: the authors' arch config (yaml or json; arch.name picks the "
                              "variant)")
    convert.add_argument("--seq-len", type=positive_int, metavar="N",
                         help="air: cells per puzzle when the config lacks it (81 Sudoku, 900 "
                              "maze)")
    convert.set_defaults(handler=_convert)
