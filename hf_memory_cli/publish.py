"""``hf-memory export``, ``push`` and ``card``: Hub-ready folders, their upload, their cards."""

from __future__ import annotations

import argparse

__all__ = ["add_publish_parsers"]


def _export(args: argparse.Namespace) -> None:
    from hub_cards.publish import export_folder, load_artifact

    obj = load_artifact(args.source)
    out = export_folder(obj, args.out)
    print(f"# {args.source} ({type(obj).__name__}) -> {out}: "
          f"{', '.join(sorted(p.name for p in out.iterdir()))}")


def _push(args: argparse.Namespace) -> None:
    from hub_cards.publish import push_folder

    commit = push_folder(args.folder, args.repo_id, git_root=args.git_root, tag=args.tag,
                         message=args.message, private=args.private)
    where = f"{args.git_root}/models/{args.repo_id}" if args.git_root else args.repo_id
    print(f"# pushed {args.folder} to {where} at {commit}" + (f" (tag {args.tag})"
                                                               if args.tag else ""))


def _card(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from eval_harness.family.task import family_fingerprint
    from hub_cards.publish import load_artifact
    from hub_cards.results_card import render_results_card

    records = []
    for path in args.results:
        path = Path(path) / "results.json" if Path(path).is_dir() else Path(path)
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read results from {path}: {error}") from None
    model = load_artifact(args.model_dir)
    if not hasattr(model, "config"):
        raise ValueError(f"{args.model_dir} holds a {type(model).__name__}, not a model")
    card = render_results_card(args.model_dir, records, family_fingerprint(model))
    readme = Path(args.model_dir) / "README.md"
    readme.write_text(card)
    print(f"# wrote {readme} ({len(records)} results file(s))")


def add_publish_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``export``, ``push`` and ``card`` on the ``hf-memory`` parser."""
    export = commands.add_parser(
        "export", help="write a model, bank set or selector as a Hub-ready folder",
        description="Load a saved ASM / AIR / Arith model, bank set or selector folder and write "
                    "it as a folder a Hub repo holds as it is: safetensors weights, config.json "
                    "with auto_map, the family's code files, generation_config.json where it "
                    "applies, and a README card.")
    export.add_argument("source", metavar="SRC", help="a save_pretrained folder")
    export.add_argument("out", metavar="OUT_DIR", help="where to write the Hub-ready folder")
    export.set_defaults(handler=_export)
    push = commands.add_parser(
        "push", help="upload an exported folder to the Hub (or a local git mirror)",
        description="Upload FOLDER to REPO_ID through the Hub's HTTP API (HF_ENDPOINT and your "
                    "token apply), or with --git-root commit it to the git repository "
                    "GIT_ROOT/models/REPO_ID on branch main, which a self-hosted Hub server "
                    "(olah's mirror mode) serves to from_pretrained.")
    push.add_argument("folder", metavar="FOLDER", help="an exported folder")
    push.add_argument("repo_id", metavar="REPO_ID", help="org/name")
    push.add_argument("--git-root", metavar="DIR", help="commit to a local git mirror instead")
    push.add_argument("--tag", help="tag the new commit (a revision users can pin)")
    push.add_argument("--message", default="Upload with hf-memory", help="commit message")
    push.add_argument("--private", action="store_true", default=None,
                      help="create the Hub repo private")
    push.set_defaults(handler=_push)
    card = commands.add_parser(
        "card", help="write a model's README card from its measured results",
        description="Render MODEL_DIR/README.md with huggingface_hub.ModelCardData: licence, "
                    "library, tags, datasets, a model-index holding every metric of the given "
                    "results files (hf-memory eval), the training recipe from the run's log.json "
                    "when it sits beside the folder, intended use and limitations. Results of "
                    "another checkpoint are refused.")
    card.add_argument("model_dir", metavar="MODEL_DIR", help="a save_pretrained model folder")
    card.add_argument("--results", nargs="+", required=True, metavar="JSON",
                      help="results.json files (or their folders) of this model")
    card.set_defaults(handler=_card)
