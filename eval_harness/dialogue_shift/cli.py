"""``hf-memory eval dialogue-shift``: its flags, and its config with the cases it runs."""

from __future__ import annotations

from ..arguments import add_shared, csv_choices, csv_ints, non_negative, persona_recipes
from ..registry import EvalTask, lazy
from .cases import SHIFT_TURN, TRANSITIONS

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    parser.add_argument("--transitions", type=csv_choices(TRANSITIONS), metavar="T,T,...",
                        help="style transitions (default: all six, or those of --cases)")
    parser.add_argument("--turns", type=csv_ints(tuple(SHIFT_TURN)), default=list(SHIFT_TURN),
                        metavar="N,N,...", help="case lengths among 8,16,24 (default: all)")
    parser.add_argument("--branches", type=csv_choices(("a", "b")), default=["a", "b"],
                        help="branches of each root (default: a,b)")
    parser.add_argument("--post-shift-history", choices=("old", "new"), default="old",
                        help="the transcript's assistant replies after the shift in the old "
                             "style (default) or the new")
    parser.add_argument("--generate", action="store_true",
                        help="also the generation form (the model writes every turn; "
                             "post-shift replies judged by the offline style judge)")
    parser.add_argument("--cases", metavar="JSON",
                        help="your own cases (a JSON list of rows with id, root, family, "
                             "branch, turns, old, new, shift_turn, user, old_replies, "
                             "new_replies) instead of the shipped bank")
    parser.add_argument("--styles", metavar="JSON",
                        help="your own styles with --cases: {\"styles\": {name: "
                             "{\"descriptor\": ...}}, \"pairs\": [{\"pair\": [a, b], "
                             "\"calibration\": [{question, a, b}, ...]}]}; generations judged "
                             "by a reply judge fitted per pair")
    parser.add_argument("--persona-recipes", type=persona_recipes, metavar="LIST",
                        help="memory by the one-line persona call over these bank recipes "
                             "(e.g. contrast), each style's banks and sites its own, within "
                             "--cost-budget; CAA's scale within the same budget (default: the "
                             "descriptor bank with an unbudgeted behavioural selector)")
    parser.add_argument("--cost-budget", type=non_negative, default=0.1, metavar="NATS",
                        help="with --persona-recipes: nats per token of neutral text the "
                             "memory and CAA calibrations may cost (default: 0.1)")
    add_shared(parser, "--calibration-pairs", "--top-layers", "--candidate-layers",
               "--caa-layer", "--bootstrap", "--selectors", calibration_pairs=12)


def _config(args, out):
    """``(config, cases)``: the user's ``--cases`` (None: the shipped bank)."""
    from .cases import load_cases
    from .styles import load_styles
    from .task import DialogueShiftConfig

    book = load_styles(args.styles) if args.styles is not None else None
    if book is not None and args.cases is None:
        raise ValueError("--styles needs --cases: the shipped cases are written in the shipped "
                         "styles")
    cases = load_cases(args.cases, book) if args.cases is not None else None
    transitions = args.transitions or (
        sorted({f"{c.get('old')}_to_{c.get('new')}" for c in cases if isinstance(c, dict)})
        if cases else list(TRANSITIONS))
    return DialogueShiftConfig(
        transitions=transitions, lengths=args.turns, branches=args.branches,
        post_shift_history=args.post_shift_history, generate=args.generate,
        calibration_pairs=args.calibration_pairs, top_layers=args.top_layers,
        candidate_layers=args.candidate_layers, caa_layer=args.caa_layer,
        num_bootstrap=args.bootstrap, seed=args.seed, persona_recipes=args.persona_recipes,
        cost_budget=args.cost_budget, styles_file=args.styles,
        selectors_dir=args.selectors or str(out / "selectors")), cases


def _run(model, tokenizer, config_and_cases, seed):
    from .task import run_dialogue_shift

    return run_dialogue_shift(model, tokenizer, *config_and_cases)


TASKS = (
    EvalTask("dialogue-shift", "steering that follows a style shift mid-dialogue",
             _add_arguments, _config, _run,
             lazy("eval_harness.dialogue_shift.report", "render_dialogue_shift"),
             record=lambda config_and_cases, args: vars(config_and_cases[0])),
)
