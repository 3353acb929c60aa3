"""Your own steering without Python: ``bank build``, ``selector pairs|calibrate``, ``chat``,
``generate``.

From a sentence to a steered chat in three commands::

    hf-memory bank build --text "You talk like a pirate." --out pirate
    hf-memory selector calibrate --banks pirate --out pirate/selector
    hf-memory chat --banks pirate --selector pirate/selector
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hf_memory.recipes.persona_recipes import DEFAULT_RECIPES, RECIPES
from hf_memory.selection.defaults import DEFAULT_KV_CEILING

from .errors import CLIError
from .memory import selector_line
from .model_loading import add_model_arguments, load_model
from .types import (
    capability_ceiling,
    kv_ceiling,
    layer_spec,
    non_negative,
    persona_recipes,
    positive_int,
    strength,
    voice_budget,
)

__all__ = ["add_steering_parsers"]

ROLES = {"target": "target", "reference": "reference", "aux": "auxiliary",
         "auxiliary": "auxiliary"}
CHAT_HELP = """commands:
  /plain            answer without the banks from now on (the conversation is kept)
  /memory           steer with the banks again
  /banks DIR        steer with another saved bank set from now on
  /strength X       turn the strength dial (0: plain ... 1: as calibrated)
  /save FILE        write the conversation so far as JSON
  /help             this list
  /quit             leave (so does end of input)"""


def _read_text(args: argparse.Namespace) -> str:
    if args.file is None:
        return args.text
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CLIError(f"{args.file} is not UTF-8 text") from None
    if not text.strip():
        raise CLIError(f"{args.file} is empty: a bank needs a text")
    return text.strip()


def _load_banks(path: str, model):
    from hf_memory.banks.bank_set import BankSet

    if not (Path(path) / "config.json").is_file():
        raise CLIError(f"{path} is not a saved bank set (no config.json; make one with "
                       "hf-memory bank build)")
    return BankSet.from_pretrained(path, model=model)


def _load_selector(path: str | None, model):
    if path is None:
        return None
    from hf_memory.selection.selector import Selector

    return Selector.from_pretrained(path, model=model)


def _bank_build(args: argparse.Namespace) -> None:
    from hf_memory.banks.bank_set import BankSet
    from hf_memory.recipes.shipped import persona_bank

    text = _read_text(args)
    if not text.strip():
        raise CLIError("the bank text is empty: give the sentence the bank should hold")
    out = Path(args.out)
    existing = None
    if out.exists() and any(out.iterdir()):
        if not (out / "config.json").is_file():
            raise CLIError(f"{out} exists and is not a bank set folder: choose a new --out")
    model, tokenizer = load_model(args.model, args.revision)
    if out.exists() and (out / "config.json").is_file():
        existing = _load_banks(str(out), model)
    start = time.perf_counter()
    role = ROLES[args.role]
    name = args.name or ("persona" if role == "target" else role)
    bank = persona_bank(model, tokenizer, text, role=role, name=name, gain=args.gain,
                        placement=args.placement)
    kept = [b for b in (existing or []) if b.name != name
            and not (role != "auxiliary" and b.role == role)]
    banks = BankSet([*kept, bank], model=model,
                    **({} if existing is None else {"gamma": existing.gamma,
                                                    "size_normalize": existing.size_normalize}))
    banks.save_pretrained(out)
    print(f"# {name} ({role}): {bank.num_slots} slots x {len(bank.layers)} layers, "
          f"{bank.nbytes():,} bytes, in {time.perf_counter() - start:.1f}s; {out} holds "
          + ", ".join(f"{b.name} ({b.role})" for b in banks))


def _bank_texts(banks) -> tuple[str, str | None]:
    """The target bank's source text and the reference bank's (None without one)."""
    texts = {b.role: b.provenance.get("text") for b in banks if b.role != "auxiliary"}
    if not texts.get("target"):
        raise CLIError("starter pairs need a target bank built from text (hf-memory bank build "
                       "--role target)")
    return texts["target"], texts.get("reference")


def _starter_pairs(banks, model, tokenizer, count: int, max_new_tokens: int):
    from hf_memory.recipes.starter_pairs import starter_pairs

    target, reference = _bank_texts(banks)
    start = time.perf_counter()
    pairs = starter_pairs(model, tokenizer, target, reference, count=count,
                          max_new_tokens=max_new_tokens)
    print(f"# {len(pairs)} starter pairs: the model's replies with the target text as a visible "
          f"system prompt vs {'the reference text' if reference else 'plain'} "
          f"({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    return pairs


def _keep_starter_pairs(pairs, out: Path, remedy: str) -> None:
    """Write starter pairs to ``out/pairs.jsonl`` for the user to edit; too few is an error."""
    from hf_memory.selection.pairs import MIN_PAIRS, write_pairs

    if len(pairs) < MIN_PAIRS:
        raise CLIError(f"only {len(pairs)} starter pairs differ (at least {MIN_PAIRS} are "
                       f"needed): {remedy}")
    out.mkdir(parents=True, exist_ok=True)
    write_pairs(out / "pairs.jsonl", pairs)
    print(f"# {len(pairs)} starter pairs in {out / 'pairs.jsonl'} (edit them and pass --pairs "
          "to recalibrate)", file=sys.stderr)


def _selector_pairs(args: argparse.Namespace) -> None:
    from hf_memory.selection.pairs import MIN_PAIRS, write_pairs

    model, tokenizer = load_model(args.model, args.revision)
    banks = _load_banks(args.banks, model)
    pairs = _starter_pairs(banks, model, tokenizer, args.count, args.max_new_tokens)
    write_pairs(args.out, pairs)
    print(f"# wrote {len(pairs)} pairs to {args.out}: one JSON object per line with prompt, "
          "target (the reply you want) and reference (the reply you do not); edit them, keep at "
          f"least {MIN_PAIRS}, then: hf-memory selector calibrate --banks {args.banks} "
          f"--pairs {args.out} --out DIR")


def _selector_calibrate(args: argparse.Namespace) -> None:
    from hf_memory.selection.pairs import read_pairs
    from hf_memory.selection.selector import Selector

    pairs = read_pairs(args.pairs) if args.pairs else None
    model, tokenizer = load_model(args.model, args.revision)
    banks = _load_banks(args.banks, model)
    out = Path(args.out)
    if pairs is None:
        pairs = _starter_pairs(banks, model, tokenizer, args.count, args.max_new_tokens)
        _keep_starter_pairs(pairs, out, "write your own with hf-memory selector pairs and edit "
                                        "them")
    budget = None if args.no_budget else args.cost_budget
    start = time.perf_counter()
    selector = Selector.calibrate_behavioural(
        model, tokenizer, banks, pairs, top_layers=args.top_layers, cost_budget=budget,
        candidate_layers=args.candidate_layers, layer_stride=args.layer_stride,
        workers=args.workers)
    selector.save_pretrained(out)
    print(f"# {selector_line(selector, budget)} in {time.perf_counter() - start:.0f}s; "
          f"wrote {out}")


def _persona(args: argparse.Namespace) -> None:
    from hf_memory.recipes.persona import calibrate_persona
    from hf_memory.selection.pairs import read_pairs

    text = _read_text(args)
    if not text.strip():
        raise CLIError("the persona text is empty: give the sentence that describes it")
    pairs = read_pairs(args.pairs) if args.pairs else None
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise CLIError(f"{out} exists and is not a bank set folder: choose a new --out")
    model, tokenizer = load_model(args.model, args.revision)
    if pairs is None:
        from hf_memory.recipes.starter_pairs import starter_pairs

        pairs = starter_pairs(model, tokenizer, text, count=args.count,
                              max_new_tokens=args.max_new_tokens)
        _keep_starter_pairs(pairs, out, "write your own and pass --pairs")
    start = time.perf_counter()
    found = calibrate_persona(model, tokenizer, text, pairs, recipes=args.recipes,
                              cost_budget=args.cost_budget, top_layers=args.top_layers,
                              layer_stride=args.layer_stride, kv_ceiling=args.kv_ceiling,
                              capability_ceiling=args.capability_ceiling,
                              workers=args.workers, voice=args.voice,
                              voice_budget=args.voice_budget)
    found.save_pretrained(out)
    for trial in found.trials:
        if "skipped" in trial:
            print(f"# {trial['recipe']}: skipped, {trial['skipped']}")
            continue
        held = trial["validation_target"]
        capability = trial["capability"]
        print(f"# {trial['recipe']}: layers {trial['layers']}, strength {trial['strength']:g}, "
              f"gain {trial['gain']:g}, cost {trial['cost']:+.3f} nats/token"
              + ("" if capability is None else f", {capability:+.2f} nats/factual answer")
              + f", KV {trial['kv_fraction']:.2f}x the prompt's; calibration "
              f"shift {trial['calibration_target']:+.2f}"
              + ("" if held is None else f", validation shift {held:+.2f}") + " nats")
    _print_voice(found.voice)
    _print_judged(found.judged)
    print(f"# kept {found.recipe} in {time.perf_counter() - start:.0f}s; wrote {out} (chat: "
          f"hf-memory chat --banks {out} --selector {out / 'selector'})")


def _print_voice(voice: dict | None) -> None:
    """The voice band's line: what it found and whether it replaced the recipe's sites."""
    if voice is None:
        return
    if "judged" not in voice:
        print(f"# voice band: none, {voice.get('refused') or voice.get('skipped')}")
        return
    slots = "every slot" if voice["slots"] is None else f"{len(voice['slots'])} slots"
    print(f"# voice band: layers {voice['layers'][0]}-{voice['layers'][-1]} ({slots}), rho "
          f"{voice['rho']:g}, cost {voice['cost']:+.3f} nats/token (budget "
          f"{voice['budget']:.3f}), KV {voice['kv_fraction']:.2f}x the prompt's; its replies "
          f"judged {voice['judged']:.2f} against the sites' {voice['sites_judged']:.2f}: "
          + ("kept in their place" if voice["kept"] else "not kept"))


def _print_judged(judged: dict | None) -> None:
    """The persona call's judged replies, a line per method."""
    if judged is None:
        return
    if "refused" in judged:
        print(f"# replies not judged: {judged['refused']}")
        return
    accuracy = judged["judge"]["held_out_accuracy"]
    print(f"# replies to {judged['prompts']} of the pairs' prompts, judged by a judge fitted on "
          f"your pairs (held-out accuracy {accuracy:.2f}; 1 = your persona's voice):")
    for name, row in judged["methods"].items():
        print(f"#   {name}: judged {row['judge_score']:.2f} ({row['target_share']:.0%} on the "
              f"persona's side), perplexity {row['perplexity'] or float('nan'):.1f}, "
              f"distinct-2 {row['distinct_2']:.2f}")


def _check_sites(args: argparse.Namespace) -> None:
    """Steering arguments that fit together (before any model is loaded)."""
    if not args.banks:
        if args.selector or args.layers:
            raise CLIError("--selector and --layers steer banks: give --banks too")
        return
    if args.selector and args.layers:
        raise CLIError("give --selector or --layers, not both")
    if not args.selector and not args.layers:
        raise CLIError("steering needs its sites: --selector DIR (hf-memory selector calibrate) "
                       "or hand-picked --layers, e.g. 12-16")


def _sites(args: argparse.Namespace, model) -> dict:
    """``{"selector": ...}``, ``{"layers": ...}`` or ``{}`` (plain), as :func:`_check_sites`
    allowed."""
    if args.layers:
        return {"layers": args.layers}
    return {"selector": _load_selector(args.selector, model)} if args.selector else {}


class _Chat:
    """The chat loop's state: one conversation (one cache) and what steers it."""

    def __init__(self, args: argparse.Namespace) -> None:
        from hf_memory.steering.conversation import Conversation

        _check_sites(args)
        self.model, self.tokenizer = load_model(args.model, args.revision)
        self.banks = _load_banks(args.banks, self.model) if args.banks else None
        self.sites = _sites(args, self.model)
        self.max_new_tokens = args.max_new_tokens
        self.conversation = Conversation(self.model, self.tokenizer, banks=self.banks,
                                         system=args.system, strength=args.strength,
                                         **self.sites)

    def describe(self) -> str:
        if self.conversation.handle is None:
            return "plain"
        banks = ", ".join(f"{b.name} ({b.role})" for b in self.banks)
        return f"memory: {banks}, strength {self.conversation.handle.strength:g}"

    def command(self, line: str) -> bool:
        """Run a slash command; False when the chat should end."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            print(CHAT_HELP)
        elif name == "/plain":
            self.conversation.set_banks(None)
            print(f"# {self.describe()}")
        elif name == "/memory":
            if self.banks is None:
                raise ValueError("no banks loaded: /banks DIR first")
            self.conversation.set_banks(self.banks)
            print(f"# {self.describe()}")
        elif name == "/banks":
            if not rest:
                raise ValueError("/banks needs a folder: /banks DIR")
            if not self.sites:
                raise ValueError("this chat has no sites to steer at: restart it with "
                                 "--banks and --selector or --layers")
            banks = _load_banks(rest, self.model)
            self.conversation.set_banks(banks)
            self.banks = banks
            print(f"# {self.describe()}")
        elif name == "/strength":
            try:
                value = float(rest)
            except ValueError:
                raise ValueError(f"/strength needs a number in [0, 1], got {rest!r}") from None
            self.conversation.set_strength(value)
            print(f"# {self.describe()}")
        elif name == "/save":
            if not rest:
                raise ValueError("/save needs a file name: /save FILE")
            from hf_memory.artifacts.atomic_files import write_json

            write_json(Path(rest), {"messages": self.conversation.messages,
                                    "steering": self.describe()})
            print(f"# saved {len(self.conversation.messages)} messages to {rest}")
        else:
            raise ValueError(f"unknown command {name!r} (nothing was sent); /help lists them")
        return True

    def say(self, text: str) -> None:
        from transformers import TextStreamer

        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        print("bot> ", end="", flush=True)
        self.conversation.say(text, max_new_tokens=self.max_new_tokens, streamer=streamer)


def _chat(args: argparse.Namespace) -> None:
    chat = _Chat(args)
    print(f"# {chat.model.name_or_path}; {chat.describe()}; /help lists the commands")
    try:
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print()
                break
            if not line.strip():
                continue
            if line.lstrip().startswith("/"):
                try:
                    if not chat.command(line):
                        break
                except (ValueError, OSError) as error:
                    print(f"# error: {error}")
                continue
            chat.say(line)
    finally:
        chat.conversation.close()


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts:
        path = Path(args.prompts)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise CLIError(f"{path} is not UTF-8 text") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    line = json.loads(line)["prompt"]
                except (json.JSONDecodeError, RecursionError, KeyError, TypeError):
                    raise CLIError(f"{path}, line {number}: a JSON line needs a \"prompt\" "
                                   "field") from None
            prompts.append(line)
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise CLIError("give non-empty prompts with --prompt TEXT or --prompts FILE")
    return prompts


def _generate(args: argparse.Namespace) -> None:
    from hf_memory.baselines.methods import MemoryMethod, generate_with
    from hf_memory.chat.generation import generate_chat

    prompts = _prompts(args)
    _check_sites(args)
    model, tokenizer = load_model(args.model, args.revision)
    banks = _load_banks(args.banks, model) if args.banks else None
    sites = _sites(args, model)
    if banks is None:
        replies = generate_chat(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)
    else:
        method = MemoryMethod(banks, strength=args.strength, **sites)
        replies = generate_with(method, model, tokenizer, prompts,
                                max_new_tokens=args.max_new_tokens)
    for prompt, reply in zip(prompts, replies, strict=True):
        record = {"prompt": prompt, "reply": reply,
                  "method": "plain" if banks is None else "memory"}
        if banks is not None:
            record["strength"] = args.strength
        print(json.dumps(record, ensure_ascii=False), flush=True)


def _steering_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--banks", metavar="DIR", help="a saved bank set (hf-memory bank build)")
    parser.add_argument("--selector", metavar="DIR",
                        help="a saved selector: where and how strongly to steer")
    parser.add_argument("--layers", type=layer_spec, metavar="SPEC",
                        help="hand-picked layers instead of a selector, e.g. 12-16 or 3,5,9")
    parser.add_argument("--strength", type=strength, default=1.0, metavar="X",
                        help="the strength dial in [0, 1] (1: as calibrated; default 1)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                        help="tokens per reply (default: 64)")
    add_model_arguments(parser)


def _text_arguments(parser: argparse.ArgumentParser, text_help: str) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help=text_help)
    source.add_argument("--file", metavar="FILE", help="a UTF-8 text file to read it from")


def _search_arguments(parser: argparse.ArgumentParser, *, top_layers: int) -> None:
    """The budgeted search's knobs, the same for ``selector calibrate`` and ``persona``."""
    parser.add_argument("--top-layers", type=positive_int, default=top_layers, metavar="M",
                        help=f"layer budget (default: {top_layers})")
    parser.add_argument("--cost-budget", type=non_negative, default=0.1, metavar="NATS",
                        help="the most a configuration may cost, in nats per token of neutral "
                             "text (default: 0.1)")
    parser.add_argument("--layer-stride", type=positive_int, default=3, metavar="K",
                        help="score every K-th candidate layer alone (default: 3)")
    parser.add_argument("--workers", type=positive_int, default=None, metavar="N",
                        help="threads that measure independent configurations side by side, "
                             "to the same numbers (default: 2 where the process may use two "
                             "cores; 1: one after the other)")


def _pair_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=positive_int, default=24, metavar="N",
                        help="starter pairs: questions to ask (default: 24)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=40, metavar="N",
                        help="starter pairs: tokens per reply (default: 40)")


def add_steering_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``bank``, ``selector``, ``chat`` and ``generate``."""
    bank = commands.add_parser("bank", help="build memory banks from your own text",
                               description="Build and collect memory banks.")
    bank_actions = bank.add_subparsers(dest="action", metavar="<action>", required=True)
    build = bank_actions.add_parser(
        "build", help="a bank from a sentence or a file",
        description="Run the text through the model as a system message and keep the keys and "
                    "values of its tokens at every layer (the demo's recipe). A folder that "
                    "already holds a bank set gets the new bank added (a bank with the same "
                    "name, or the same target/reference role, is replaced).")
    _text_arguments(build, "the sentence, e.g. 'You talk like a pirate.'")
    build.add_argument("--role", choices=sorted(ROLES), default="target",
                       help="target (steer towards), reference (away from) or aux (default: "
                            "target)")
    build.add_argument("--name", help="the bank's name (default: persona for a target bank, "
                                      "else the role)")
    build.add_argument("--gain", type=non_negative, default=1.0, help="bank gain (default: 1)")
    build.add_argument("--placement", choices=("free", "before"), default="free",
                       help="free: the slots carry no position (default); before: each slot sits "
                            "where its text would if it came just before the conversation, so "
                            "the slots meet the query as a visible prompt's keys would")
    build.add_argument("--out", required=True, metavar="DIR", help="the bank set folder")
    add_model_arguments(build)
    build.set_defaults(handler=_bank_build)

    selector = commands.add_parser("selector", help="where to steer: calibrate a selector",
                                   description="Write calibration pairs and calibrate a "
                                               "selector on them.")
    actions = selector.add_subparsers(dest="action", metavar="<action>", required=True)
    pairs = actions.add_parser(
        "pairs", help="write starter calibration pairs to edit",
        description="Ask the model everyday questions with the target bank's text as a visible "
                    "system prompt and without it (or with the reference bank's text), and "
                    "write the replies as JSON lines of prompt / target / reference.")
    pairs.add_argument("--banks", required=True, metavar="DIR")
    pairs.add_argument("--out", required=True, metavar="FILE", help="the .jsonl file to write")
    _pair_arguments(pairs)
    add_model_arguments(pairs)
    pairs.set_defaults(handler=_selector_pairs)
    calibrate = actions.add_parser(
        "calibrate", help="calibrate a selector for a bank set",
        description="Search the layers, units and strength where the banks move the pairs "
                    "towards their target replies most within a cost budget on neutral text "
                    "(net of a neutral bank), and save the frozen selector. Without --pairs, "
                    "starter pairs are written first (into OUT/pairs.jsonl).")
    calibrate.add_argument("--banks", required=True, metavar="DIR")
    calibrate.add_argument("--pairs", metavar="FILE",
                           help="JSON lines of {prompt, target, reference}, at least 8")
    calibrate.add_argument("--out", required=True, metavar="DIR")
    _search_arguments(calibrate, top_layers=5)
    calibrate.add_argument("--no-budget", action="store_true",
                           help="the unbudgeted search (largest movement; may damage the model)")
    calibrate.add_argument("--candidate-layers", type=layer_spec, metavar="SPEC",
                           help="layers the search may pick (default: every layer)")
    _pair_arguments(calibrate)
    add_model_arguments(calibrate)
    calibrate.set_defaults(handler=_selector_calibrate)

    persona = commands.add_parser(
        "persona", help="your own persona in one command: banks and a selector",
        description="Build the persona's banks by each recipe (prompt_like: the text where a "
                    "visible system prompt would sit; exemplars: the text and example replies "
                    "from the pairs; contrast: two such banks, the pairs' persona replies "
                    "against their other replies, steering by the difference; descriptor: the "
                    "paper's bank), calibrate a selector for each within the cost budget on the "
                    "pairs (a third held out to drop sites that do not hold), and keep the "
                    "recipe that moves the held-out pairs furthest. Without --pairs, starter "
                    "pairs are written first.")
    _text_arguments(persona, "the persona, e.g. 'I am always cheerful.'")
    persona.add_argument("--pairs", metavar="FILE",
                         help="JSON lines of {prompt, target, reference}, at least 8 (~20 "
                              "recommended)")
    persona.add_argument("--out", required=True, metavar="DIR",
                         help="the bank set folder (its selector goes to DIR/selector)")
    persona.add_argument("--recipes", type=persona_recipes, default=list(DEFAULT_RECIPES),
                         metavar="LIST",
                         help=f"comma-separated bank recipes to try (default: "
                              f"{','.join(DEFAULT_RECIPES)}; also "
                              f"{','.join(r for r in RECIPES if r not in DEFAULT_RECIPES)})")
    persona.add_argument("--kv-ceiling", type=kv_ceiling, default=DEFAULT_KV_CEILING,
                         metavar="SHARE",
                         help="the most KV memory the banks may carry, as a share of the "
                              "persona text's KV as a visible prompt (default: "
                              f"{DEFAULT_KV_CEILING:g}; none: no ceiling)")
    persona.add_argument("--capability-ceiling", type=capability_ceiling, default="prompt",
                         metavar="NATS",
                         help="nats per factual answer the steering may cost (default: prompt, "
                              "the visible prompt's own cost plus a little; none: not charged)")
    persona.add_argument("--voice", action="store_true",
                         help="also look for a voice band (the text at a band of upper layers, "
                              "fewer slots to fit the KV ceiling, chosen by a judge of the "
                              "replies fitted on the pairs) and keep it when its replies are "
                              "judged higher than the sites'")
    persona.add_argument("--voice-budget", type=voice_budget, default="prompt",
                         metavar="NATS",
                         help="what the voice band may cost per token of neutral text "
                              "(default: prompt, the visible prompt's own cost)")
    _search_arguments(persona, top_layers=6)
    _pair_arguments(persona)
    add_model_arguments(persona)
    persona.set_defaults(handler=_persona)

    chat = commands.add_parser(
        "chat", help="an interactive steered chat (one KV cache; /help for commands)",
        description="Chat with the model, steered by a bank set from the first turn; the "
                    "history stays in one KV cache. Tokens stream as they are generated.")
    _steering_arguments(chat)
    chat.add_argument("--system", metavar="TEXT", help="a visible system message")
    chat.set_defaults(handler=_chat)

    generate = commands.add_parser(
        "generate", help="one-shot steered replies as JSON lines",
        description="Answer each prompt (one batch) and print one JSON object per prompt: "
                    "prompt, reply, method, strength.")
    _steering_arguments(generate)
    generate.add_argument("--prompt", action="append", metavar="TEXT",
                          help="a prompt (repeatable)")
    generate.add_argument("--prompts", metavar="FILE",
                          help="prompts, one per line (or JSON lines with a prompt field)")
    generate.set_defaults(handler=_generate)
