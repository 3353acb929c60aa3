"""``hf-memory export`` and ``hf-memory push``: Hub-ready folders and their upload."""

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


def add_publish_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``export`` and ``push`` on the ``hf-memory`` parser."""
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
