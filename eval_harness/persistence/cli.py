"""``hf-memory eval persistence``: its flags and config."""

from __future__ import annotations

from ..arguments import add_shared, non_negative_list, positive_int
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    add_shared(parser, "--directions")
    parser.add_argument("--lengths", type=non_negative_list(int, "token counts"),
                        default=[0, 256, 1024, 2048], metavar="N,N,...",
                        help="opposite-style history lengths in tokens (default: "
                             "0,256,1024,2048)")
    parser.add_argument("--items", type=positive_int, default=8, metavar="N",
                        help="held-out items per direction (default: 8)")
    add_shared(parser, "--bootstrap", "--selectors")


def _config(args, out):
    from .task import PersistenceConfig

    return PersistenceConfig(directions=args.directions, lengths=args.lengths, items=args.items,
                             num_bootstrap=args.bootstrap, seed=args.seed,
                             selectors_dir=args.selectors or str(out / "selectors"))


TASKS = (
    EvalTask("persistence", "whether steering persists over a conversation", _add_arguments,
             _config, config_run("eval_harness.persistence.task", "run_persistence"),
             lazy("eval_harness.persistence.report", "render_persistence")),
)
