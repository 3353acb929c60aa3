"""``hf-memory eval ffn-memories``: its flags and config (the analysis runs in
:mod:`hf_memory.analysis`)."""

from __future__ import annotations

from ..arguments import add_shared, layer_spec
from ..registry import EvalTask, lazy

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    add_shared(parser, "--sentences")
    parser.add_argument("--layers", type=layer_spec, metavar="SPEC",
                        help="the layers analysed, e.g. 0,14,29 (default: all)")


def _run(model, tokenizer, config, seed):
    from hf_memory.analysis.corpus import (
        CORPUS_LICENSE,
        CORPUS_SOURCE,
        kjv_sentences,
        tokenize_corpus,
    )
    from hf_memory.analysis.report import analyze_ffn_memories

    corpus = tokenize_corpus(tokenizer, kjv_sentences(config["sentences"], seed=seed))
    results, _, _ = analyze_ffn_memories(model, corpus, tokenizer=tokenizer,
                                         layers=config["layers"],
                                         sample_size=min(1000, config["sentences"] * 4),
                                         seed=seed)
    results["corpus"].update(source=CORPUS_SOURCE, license=CORPUS_LICENSE)
    return results


TASKS = (
    EvalTask("ffn-memories", "FFN layers as key-value memories over KJV sentences",
             _add_arguments,
             lambda args, out: {"sentences": args.sentences, "model": args.model,
                                "layers": args.layers},
             _run, lazy("eval_harness.ffn_memories.report", "render_ffn_memories")),
)
