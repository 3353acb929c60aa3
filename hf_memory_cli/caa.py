"""CAA vectors from the command line, and out to other tools: ``caa extract``,
``caa export control-vector`` (llama.cpp), ``caa export lm-eval-steer`` (lm-eval's ``steered``
model). (``hf-memory export`` is the Hub-folder export.)

From your pairs to llama.cpp in two commands::

    hf-memory caa extract --pairs pairs.jsonl --layers 10-20 --site block_output --out vectors
    hf-memory caa export control-vector --vectors vectors --out persona.gguf
    llama-cli -m model.gguf --control-vector persona.gguf ...
"""

from __future__ import annotations

import argparse

from .model_loading import add_model_arguments, load_model
from .types import finite, layer_spec

__all__ = ["add_caa_parsers"]


def _load_vectors(path: str):
    from hf_memory.baselines.caa import CAAVectors

    return CAAVectors.from_pretrained(path)


def _extract(args: argparse.Namespace) -> None:
    from hf_memory.baselines.caa import CAAVectors
    from hf_memory.selection.pairs import read_pairs

    pairs = read_pairs(args.pairs)
    model, tokenizer = load_model(args.model, args.revision)
    vectors = CAAVectors.extract(
        model, tokenizer, [(f"{p} {t}", f"{p} {r}") for p, t, r in pairs], layers=args.layers,
        position=args.position, scale=args.scale, site=args.site)
    vectors.save_pretrained(args.out)
    print(f"# {len(pairs)} pairs -> CAA vectors at layers {vectors.layers} ({args.site}, scale "
          f"{args.scale}) in {args.out}")


def _export_control_vector(args: argparse.Namespace) -> None:
    from hf_memory.baselines.caa import export_control_vector

    vectors = _load_vectors(args.vectors)
    path = export_control_vector(vectors, args.out, model_hint=args.model_hint)
    print(f"# {args.vectors} -> {path}: llama.cpp control vector, directions at layers "
          f"{vectors.layers}, scale {vectors.scale} baked in (use it with --control-vector; "
          "--control-vector-scaled FILE S multiplies it by S)")


def _export_lm_eval_steer(args: argparse.Namespace) -> None:
    from hf_memory.baselines.caa_lm_eval import export_lm_eval_steer

    vectors = _load_vectors(args.vectors)  # a bad file fails before the model loads
    model, _ = load_model(args.model, args.revision)
    path = export_lm_eval_steer(vectors, model, args.out)  # checks the vectors fit the model
    print(f"# {args.vectors} -> {path}: lm_eval --model steered --model_args "
          f"pretrained=MODEL,steer_path={path}")


def add_caa_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``caa extract`` and ``caa export control-vector|lm-eval-steer``."""
    caa = commands.add_parser("caa", help="contrastive activation addition vectors",
                              description="CAA: the mean residual difference of your pairs.")
    actions = caa.add_subparsers(dest="action", metavar="<action>", required=True)
    extract = actions.add_parser(
        "extract", help="CAA vectors from your pairs",
        description="Mean (prompt + target) − (prompt + reference) residual at LAYERS, saved as "
                    "a folder CAAVectors.from_pretrained, the harness and lm-eval's hf-memory "
                    "model read.")
    extract.add_argument("--pairs", required=True, metavar="FILE",
                         help="JSON lines with prompt, target and reference (as hf-memory "
                              "selector pairs writes)")
    extract.add_argument("--layers", required=True, type=layer_spec, metavar="SPEC",
                         help="layers, e.g. 10-20 or 3,5,9")
    extract.add_argument("--site", choices=("post_attention", "block_output"),
                         default="post_attention",
                         help="where the residual is read and steered: right after attention "
                              "(default) or at the layer's output (llama.cpp's site)")
    extract.add_argument("--position", choices=("mean", "last"), default="mean",
                         help="average over the text's tokens (default) or its last token")
    extract.add_argument("--scale", type=finite, default=1.0, metavar="X",
                         help="the vectors' scale (default: 1)")
    extract.add_argument("--out", required=True, metavar="DIR")
    add_model_arguments(extract)
    extract.set_defaults(handler=_extract)

    export = actions.add_parser("export", help="CAA vectors in other tools' formats")
    formats = export.add_subparsers(dest="format", metavar="<format>", required=True)
    gguf = formats.add_parser(
        "control-vector", help="a llama.cpp control-vector GGUF",
        description="Write block-output CAA vectors as a llama.cpp control vector "
                    "(direction.<layer> tensors, the scale baked in). Post-attention vectors "
                    "are refused: llama.cpp adds at each layer's output.")
    gguf.add_argument("--vectors", required=True, metavar="DIR",
                      help="CAA vectors (hf-memory caa extract --site block_output)")
    gguf.add_argument("--out", required=True, metavar="FILE.gguf")
    gguf.add_argument("--model-hint", metavar="TYPE",
                      help="controlvector.model_hint (default: the vectors' model_type)")
    gguf.set_defaults(handler=_export_control_vector)
    steer = formats.add_parser(
        "lm-eval-steer", help="the .pt file of lm-eval's steered model",
        description="Write CAA vectors (a folder or a control-vector .gguf) as lm-eval's "
                    "--model steered file: hookpoints of MODEL, vector and coefficient.")
    steer.add_argument("--vectors", required=True, metavar="DIR|FILE.gguf")
    steer.add_argument("--out", required=True, metavar="FILE.pt")
    add_model_arguments(steer)
    steer.set_defaults(handler=_export_lm_eval_steer)

