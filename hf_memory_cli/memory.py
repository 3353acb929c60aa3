"""``hf-memory demo`` and ``hf-memory build-selector``: memory inception on the embedded model."""

from __future__ import annotations

import argparse
import time

from hf_memory.recipes.demo import DEFAULT_DIRECTION, DEFAULT_GAIN, DEFAULT_PROMPTS
from hf_memory.recipes.shipped import DEMO_PERSONA, SHIPPED_PERSONAS
from hf_memory.selection.defaults import DEFAULT_COST_BUDGET

from .errors import CLIError
from .types import layer_spec, non_negative, positive_int

__all__ = ["add_memory_parsers", "selector_line"]


def _demo(args: argparse.Namespace) -> None:
    import_start = time.perf_counter()
    import transformers  # noqa: F401  (imported here so the load time below is the load alone)

    from hf_memory.models.default_model import DefaultModelUnavailableError, load_default_model
    from hf_memory.recipes.demo import format_demo, run_demo

    start = time.perf_counter()
    try:
        model, tokenizer = load_default_model()
    except DefaultModelUnavailableError as error:
        raise CLIError(str(error)) from error
    loaded = time.perf_counter()
    print(f"# {model.name_or_path} ({model.config.model_type}, "
          f"{model.config.num_hidden_layers} layers) loaded in {loaded - start:.1f}s "
          f"(imports {start - import_start:.1f}s)")
    print(f"# persona: {args.persona}")
    selector = None
    if args.selector:
        from hf_memory.selection.selector import Selector

        selector = Selector.from_pretrained(args.selector, model=model)
    try:
        result = run_demo(model, tokenizer, persona=args.persona, reference=args.reference,
                          prompts=args.prompt or DEFAULT_PROMPTS, layers=args.layers,
                          gain=args.gain, selector=selector,
                          max_new_tokens=args.max_new_tokens)
    except ValueError as error:
        raise CLIError(str(error)) from error
    print(format_demo(result))


def _build_selector(args: argparse.Namespace) -> None:
    from hf_memory.models.default_model import load_default_model
    from hf_memory.recipes.shipped import build_selector, selectors_dir

    if args.persona and args.no_budget:
        raise CLIError("a shipped persona is always calibrated within a cost budget (its own "
                       "rule, or --cost-budget), not with --no-budget")
    model, tokenizer = load_default_model()
    start = time.perf_counter()
    if args.persona:
        from hf_memory.recipes.shipped import build_persona

        found = build_persona(model, tokenizer, args.persona, out=args.out,
                              cost_budget=args.cost_budget)
        print(f"# {args.persona}: kept the {found.recipe} recipe; "
              f"{selector_line(found.selector, found.selector.config['cost_budget'])} in "
              f"{time.perf_counter() - start:.0f} s")
        return
    budget = (None if args.no_budget else
              DEFAULT_COST_BUDGET if args.cost_budget is None else args.cost_budget)
    selector = build_selector(model, tokenizer, args.direction, top_layers=args.top_layers,
                              cost_budget=budget)
    out = args.out or str(selectors_dir().joinpath(args.direction))
    selector.save_pretrained(out)
    print(f"# {args.direction}: {selector_line(selector, budget)} in "
          f"{time.perf_counter() - start:.0f} s; wrote {out}")


def selector_line(selector, budget: float | None) -> str:
    """What a calibration chose, in one line: sites, strength and cost, shift and drift."""
    best = selector.config["best"]
    within = ("" if budget is None else f"strength {selector.strength:g} at cost "
              f"{best['cost']:+.3f} nats/token (budget {budget:g}), ")
    return (f"layers {selector.layers} ({selector.unit_type} units {selector.units}), gain "
            f"{best['gain']:g}, {within}calibration target shift {best['target']:+.2f} nats, "
            f"drift {best['drift']:.2f}; {selector.config['num_pairs']} pairs, "
            f"{selector.config['evaluations']} configurations")


def _direction(text: str) -> str:
    from hf_memory.recipes.calibration_data import direction_parts

    try:
        direction_parts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_memory_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``demo`` and ``build-selector`` on the ``hf-memory`` parser."""
    demo = commands.add_parser(
        "demo", help="memory inception on the embedded SmolLM2-135M-Instruct: plain vs prompt "
                     "vs memory-steered answers",
        description="Answer prompts plain, with the persona as a visible system prompt, with "
                    "CAA and memory-steered (the shipped persona's calibrated recipe and sites), "
                    "with the KV bytes of each, the share of the persona's own words in the "
                    "replies, and their repetition.",
    )
    demo.add_argument("--persona", default=DEMO_PERSONA, metavar="TEXT",
                      help="a shipped persona's name, or the descriptor the bank is built from "
                           f"(default: {DEMO_PERSONA}; the Big Five descriptors have shipped "
                           "selectors too)")
    demo.add_argument("--reference", metavar="TEXT",
                      help="an opposite descriptor for a contrastive reference bank")
    demo.add_argument("--layers", type=layer_spec, metavar="SPEC",
                      help="hand-picked steered layers, e.g. 18-22 or 3,5,9-10 (default: the "
                           "frozen selector shipped for the persona)")
    demo.add_argument("--selector", metavar="DIR",
                      help="a saved selector to steer through (Selector.save_pretrained)")
    demo.add_argument("--gain", type=non_negative, default=DEFAULT_GAIN,
                      help=f"bank gain lambda with --layers (default: {DEFAULT_GAIN})")
    demo.add_argument("--prompt", action="append", metavar="TEXT",
                      help="a prompt to answer (repeatable; default: four built-in prompts)")
    demo.add_argument("--max-new-tokens", type=positive_int, default=40, metavar="N",
                      help="tokens to generate per answer (default: 40)")
    demo.set_defaults(handler=_demo)
    build = commands.add_parser(
        "build-selector", help="calibrate the behavioural selector for a Big Five direction",
        description="Search the sites (layers, units and strength) where the direction's "
                    "descriptor bank moves the shipped calibration pairs towards the target "
                    "(net of a neutral bank) and not the other traits, within a cost budget on "
                    "neutral text, and save the frozen selector (default: the package's own "
                    "copy, which hf-memory demo uses).")
    build.add_argument("--direction", default=DEFAULT_DIRECTION, type=_direction,
                       help=f"e.g. N+ (anxious) or N- (calm) (default: {DEFAULT_DIRECTION})")
    build.add_argument("--persona", choices=SHIPPED_PERSONAS,
                       help="instead of a direction: calibrate a shipped persona (memory recipe "
                            "and selector, CAA layer and scale) on its own pairs")
    build.add_argument("--top-layers", type=positive_int, default=5, metavar="M",
                       help="layer budget (default: 5)")
    build.add_argument("--cost-budget", type=non_negative, metavar="NATS",
                       help="the most a configuration may cost, in nats per token of neutral "
                            f"text (default: {DEFAULT_COST_BUDGET}; with --persona: the persona's "
                            "own rule in its persona.json, e.g. the visible prompt's cost)")
    build.add_argument("--no-budget", action="store_true",
                       help="the unbudgeted search (largest movement over the gain grid)")
    build.add_argument("--out", metavar="DIR", help="where to save (default: package data)")
    build.set_defaults(handler=_build_selector)
