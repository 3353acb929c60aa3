"""``hf-memory eval trait-steering`` and ``layer-ablation``: their flags and configs."""

from __future__ import annotations

from ..arguments import (
    add_shared,
    non_negative_int,
    persona_recipes,
    positive_floats,
    positive_int,
    unit_interval,
)
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _add_common(parser) -> None:
    add_shared(parser, "--directions", "--limit", "--candidate-layers", "--calibration-pairs",
               "--top-layers", "--caa-layer", "--bootstrap", "--selectors",
               calibration_pairs=24)
    parser.add_argument("--cost-texts", type=positive_int, metavar="N",
                        help="measure the cost budget on the first N shipped neutral passages "
                             "and prompts (default: all; fewer is faster and noisier)")
    parser.add_argument("--validation", type=unit_interval, default=0.0, metavar="FRACTION",
                        help="hold this fraction of the calibration pairs out of the selector "
                             "search and drop the sites that do not hold on it (default: 0, the "
                             "shipped selectors' recipe)")


def _add_trait_steering(parser) -> None:
    _add_common(parser)
    parser.add_argument("--caa-scales", type=positive_floats, metavar="S,S,...",
                        help="the CAA scales the calibration tries within the cost budget "
                             "(default: 0.25,0.5,1,2,3,4,6,8,16)")
    parser.add_argument("--persona-recipes", type=persona_recipes, metavar="LIST",
                        help="calibrate memory by the one-line persona call with these bank "
                             "recipes (e.g. prompt_like,exemplars,contrast; exemplars come from "
                             "the calibration pairs) instead of the shipped selectors' "
                             "descriptor bank")
    parser.add_argument("--judge-prompts", type=non_negative_int, default=8, metavar="N",
                        help="judge plain, prompt, CAA and memory's greedy replies to N "
                             "held-out questions per direction, by a reply judge fitted on the "
                             "direction's calibration pairs (default: 8; 0: none)")


def _add_layer_ablation(parser) -> None:
    _add_common(parser)
    parser.set_defaults(caa_scales=None, persona_recipes=None, judge_prompts=0)


def _config(args, out):
    from ..directions import TraitSteeringConfig

    return TraitSteeringConfig(directions=args.directions, limit=args.limit,
                               questionnaire_limit=args.limit,
                               candidate_layers=args.candidate_layers,
                               calibration_pairs=args.calibration_pairs,
                               top_layers=args.top_layers, caa_layer=args.caa_layer,
                               **({"caa_scales": tuple(args.caa_scales)}
                                  if args.caa_scales else {}),
                               num_bootstrap=args.bootstrap, seed=args.seed,
                               cost_texts=args.cost_texts, validation=args.validation,
                               persona_recipes=args.persona_recipes,
                               judge_prompts=args.judge_prompts,
                               selectors_dir=args.selectors or str(out / "selectors"))


TASKS = (
    EvalTask("trait-steering",
             "prompt, CAA and memory inception at their calibrated strengths with controls, for "
             "the ten Big Five directions, on held-out likelihood pairs and the "
             "acquiescence-corrected IPIP-50",
             _add_trait_steering, _config,
             config_run("eval_harness.trait_steering.task", "run_trait_steering"),
             lazy("eval_harness.trait_steering.report", "render_trait_steering")),
    EvalTask("layer-ablation", "trait steering's memory with one selector layer left out at a "
             "time", _add_layer_ablation, _config,
             config_run("eval_harness.trait_steering.task", "run_layer_ablation"),
             lazy("eval_harness.trait_steering.report", "render_layer_ablation")),
)
