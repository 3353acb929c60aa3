"""``hf-memory eval guidance``: its flags and config."""

from __future__ import annotations

from ..arguments import add_shared, non_negative, persona_recipes
from ..names import RULES
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_arguments(parser) -> None:
    parser.add_argument("--rules", type=_names, metavar="R,R,...",
                        help=f"rules to run (default: every rule: {','.join(RULES)}, or those "
                             "of --rule-file)")
    parser.add_argument("--rule-file", metavar="JSON",
                        help="your own rules: {\"rules\": {name: {\"text\": ..., \"items\": "
                             "[{question, compliant, violating}, ...]}}}, judged in generation "
                             "by a reply judge fitted on each rule's examples")
    parser.add_argument("--no-generate", action="store_true",
                        help="likelihood compliance only (skip the judged generations)")
    parser.add_argument("--persona-recipes", type=persona_recipes, metavar="LIST",
                        help="memory by the one-line persona call over these bank recipes "
                             "(e.g. prompt_like,exemplars,contrast) within --cost-budget and "
                             "--kv-ceiling (default: the rule's bank at a behavioural selector)")
    parser.add_argument("--cost-budget", type=non_negative, default=0.1, metavar="NATS",
                        help="with --persona-recipes: nats per token of neutral text the memory "
                             "may cost (default: 0.1)")
    parser.add_argument("--kv-ceiling", type=non_negative, default=1 / 6, metavar="FRACTION",
                        help="with --persona-recipes: the most KV the banks may carry, as a "
                             "fraction of the rule's as a visible prompt (default: 1/6; 0: none)")
    add_shared(parser, "--top-layers", "--candidate-layers", "--bootstrap", "--selectors")


def _config(args, out):
    from .task import GuidanceConfig

    return GuidanceConfig(rules=args.rules, rule_file=args.rule_file,
                          generate=not args.no_generate, top_layers=args.top_layers,
                          candidate_layers=args.candidate_layers, num_bootstrap=args.bootstrap,
                          seed=args.seed, selectors_dir=args.selectors or str(out / "selectors"),
                          persona_recipes=args.persona_recipes, cost_budget=args.cost_budget,
                          kv_ceiling=args.kv_ceiling or None)


TASKS = (
    EvalTask("guidance", "answer-format rules (or your own) by prompt and memory",
             _add_arguments, _config,
             config_run("eval_harness.guidance.task", "run_guidance"),
             lazy("eval_harness.guidance.report", "render_guidance")),
)
