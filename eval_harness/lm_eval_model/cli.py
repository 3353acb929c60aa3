"""``hf-memory eval lm-eval``: its flags and config (lm-evaluation-harness tasks on a model
steered by at most one of banks, CAA or a prompt)."""

from __future__ import annotations

import argparse

from ..arguments import finite, non_negative_int, positive_int
from ..registry import EvalTask, lazy

__all__ = ["TASKS"]


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _add_arguments(parser) -> None:
    parser.add_argument("--tasks", type=_names, metavar="T,T,...",
                        help="lm-evaluation-harness tasks, e.g. hfm_local (the offline ones "
                             "shipped in eval_harness/lm_eval_model/tasks) or mmlu")
    parser.add_argument("--include-path", action="append", metavar="DIR",
                        help="another folder of lm-eval task YAML (repeatable)")
    parser.add_argument("--banks", metavar="DIR",
                        help="steer with this bank set (give --selector too)")
    parser.add_argument("--selector", metavar="DIR", help="the frozen selector of --banks")
    parser.add_argument("--caa", metavar="DIR", help="steer with these CAA vectors")
    parser.add_argument("--scale", type=finite,
                        help="the CAA scale (default: the vectors' saved scale)")
    parser.add_argument("--prompt", metavar="TEXT",
                        help="the prompt baseline: TEXT in the visible context")
    parser.add_argument("--docs", type=positive_int, metavar="N",
                        help="at most N documents per task (lm-eval's --limit)")
    parser.add_argument("--num-fewshot", type=non_negative_int, metavar="K",
                        help="few-shot examples (default: each task's own)")
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="render contexts through the model's chat template")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="requests per forward pass (default: 8)")


def _config(args, out):
    steering = [flag for flag, value in (("--banks", args.banks), ("--caa", args.caa),
                                         ("--prompt", args.prompt)) if value is not None]
    if len(steering) > 1:
        raise ValueError(f"choose one steering: {' and '.join(steering)} were both given")
    if args.tasks is None:
        raise ValueError("lm-eval needs --tasks (e.g. hfm_capability_mc,hfm_trait_pairs)")
    from .task import check_tasks

    include = args.include_path or []
    check_tasks(args.tasks, include)
    return {"model": args.model, "tasks": args.tasks, "include_path": include,
            "docs": args.docs, "num_fewshot": args.num_fewshot,
            "apply_chat_template": args.apply_chat_template, "batch_size": args.batch_size,
            "banks": args.banks, "selector": args.selector, "caa": args.caa,
            "scale": args.scale, "prompt": args.prompt}


def _run(model, tokenizer, config, seed):
    from .model import HFMemoryLM
    from .task import run_lm_eval

    lm = HFMemoryLM(pretrained=model, tokenizer=tokenizer, batch_size=config["batch_size"],
                    banks=config["banks"], selector=config["selector"], caa=config["caa"],
                    scale=config["scale"], prompt=config["prompt"])
    return run_lm_eval(lm, config["tasks"], include_path=config["include_path"],
                       limit=config["docs"], num_fewshot=config["num_fewshot"],
                       apply_chat_template=config["apply_chat_template"], seed=seed)


TASKS = (
    EvalTask("lm-eval", "lm-evaluation-harness tasks on the model, steered by at most one of "
             "banks, CAA or a prompt", _add_arguments, _config, _run,
             lazy("eval_harness.lm_eval_model.report", "render_lm_eval"),
             fingerprint=lazy("eval_harness.family.task", "family_fingerprint")),
)
