"""``hf-memory asm-train``: train an ASM language model, or its matched Transformer, on text."""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import CLIError
from .types import non_negative, non_negative_int, positive_float, positive_int, unit_interval

__all__ = ["add_asm_parsers"]


def _corpus(args: argparse.Namespace):
    from modeling.asm.corpus_asm import hub_corpus, kjv_corpus

    if args.corpus == "kjv":
        return kjv_corpus(args.validation_fraction)
    return hub_corpus(args.corpus, max_documents=args.max_documents)


def _tokenizer(args: argparse.Namespace, train_texts):
    from modeling.asm.corpus_asm import train_bpe_tokenizer

    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as error:
            raise CLIError(f"cannot load the tokenizer {args.tokenizer!r}: "
                           f"{str(error).splitlines()[0]}") from None
    return train_bpe_tokenizer(train_texts, args.vocab_size)


def _model(args: argparse.Namespace, tokenizer):
    from modeling.asm import ASMConfig, ASMForCausalLM

    special = {name: getattr(tokenizer, name) for name in
               ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = ASMConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_slots=args.slots, slot_space_dim=args.slot_space_dim,
        max_position_embeddings=args.block_size, chunk_size=min(64, args.block_size),
        content_gain=args.content_gain, slot_space_rope=args.slot_space_rope,
        dropout=args.dropout, **special)
    if args.arch == "asm":
        return ASMForCausalLM(config)
    from transformers import LlamaForCausalLM

    from modeling.asm.baseline_asm import matched_llama_config

    return LlamaForCausalLM(matched_llama_config(config))


def _train(args: argparse.Namespace) -> None:
    import torch
    from accelerate import PartialState

    from modeling.asm.corpus_asm import pack_blocks
    from modeling.asm.training_asm import LMTrainConfig, train_lm

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        train_config = LMTrainConfig(
            steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
            weight_decay=args.weight_decay, grad_clip=args.grad_clip, eval_every=args.eval_every,
            save_every=args.save_every, seed=args.seed, cpu=args.cpu)
        corpus = _corpus(args)
        tokenizer = _tokenizer(args, corpus["train"]["text"])
        train = pack_blocks(corpus["train"]["text"], tokenizer, args.block_size)
        validation = pack_blocks(corpus["validation"]["text"], tokenizer, args.block_size)
        torch.manual_seed(args.seed)
        model = _model(args, tokenizer)
        if args.tokenizer is None and PartialState().is_main_process:
            # written once everything above has been checked, by one process of a launch
            tokenizer.save_pretrained(Path(args.out) / "tokenizer")
        log = train_lm(model, train, validation, train_config, out=args.out,
                       tokenizer=tokenizer, resume=not args.no_resume)
    except FloatingPointError as error:
        raise CLIError(str(error)) from error
    final = log["final"]
    print(f"# {log['model_class']}, {log['num_parameters']:,} parameters, {final['step']} steps "
          f"({final['tokens']:,} tokens) in {final['wall_time_s']:.0f}s; "
          f"model: {args.out}/final, log: {args.out}/log.json")
    if "validation" in final:
        print(f"validation perplexity {final['validation']['perplexity']:.3f} "
              f"({final['validation']['tokens']:,} tokens)")


def add_asm_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``asm-train`` on the ``hf-memory`` parser."""
    train = commands.add_parser(
        "asm-train", help="train an ASM language model or its matched Transformer",
        description="Train ASMForCausalLM (--arch asm) or the stock Llama matched to it in "
                    "width, depth, heads, vocabulary and parameter count (--arch transformer) "
                    "on the offline KJV corpus (or a Hub corpus), with a byte-level BPE "
                    "tokenizer trained on the training split (saved as OUT/tokenizer; pass it "
                    "to the baseline with --tokenizer so both see the same tokens in the same "
                    "order). Writes OUT/log.json, a resumable OUT/checkpoint and OUT/final. "
                    "The defaults are the CPU-scale run of BENCHMARKS.md, not the paper's "
                    "ASM-57M. Multi-GPU: accelerate launch -m hf_memory_cli.main asm-train ...")
    train.add_argument("--out", required=True, metavar="DIR", help="output directory")
    train.add_argument("--arch", choices=("asm", "transformer"), default="asm")
    train.add_argument("--corpus", choices=("kjv", "wikitext-103", "fineweb"), default="kjv",
                       help="kjv (offline, default) or a Hub corpus")
    train.add_argument("--validation-fraction", type=unit_interval, default=0.05, metavar="F",
                       help="kjv: share of chapters held out by name hash (default 0.05)")
    train.add_argument("--max-documents", type=positive_int, default=None, metavar="N",
                       help="fineweb: documents streamed (default 100000)")
    train.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="an existing tokenizer folder (default: train a BPE)")
    train.add_argument("--vocab-size", type=positive_int, default=4096, metavar="N",
                       help="BPE vocabulary when training one (default 4096)")
    train.add_argument("--block-size", type=positive_int, default=128, metavar="T")
    train.add_argument("--hidden-size", type=positive_int, default=256, metavar="D")
    train.add_argument("--layers", type=positive_int, default=4, metavar="N")
    train.add_argument("--heads", type=positive_int, default=4, metavar="H")
    train.add_argument("--slots", type=positive_int, default=16, metavar="K")
    train.add_argument("--slot-space-dim", type=positive_int, default=32, metavar="M")
    train.add_argument("--content-gain", choices=("sigmoid", "softplus_clamp"),
                       default="sigmoid", help="gamma form: ours (sigmoid) or the authors' code")
    train.add_argument("--slot-space-rope", action="store_true",
                       help="rotary map in the slot-space refinement, as the authors' code")
    train.add_argument("--dropout", type=unit_interval, default=0.0)
    train.add_argument("--steps", type=positive_int, default=2000, metavar="N")
    train.add_argument("--batch-size", type=positive_int, default=16, metavar="N")
    train.add_argument("--lr", type=positive_float, default=1e-3)
    train.add_argument("--min-lr-ratio", type=unit_interval, default=0.1, metavar="R")
    train.add_argument("--warmup-steps", type=non_negative_int, default=100, metavar="N")
    train.add_argument("--weight-decay", type=non_negative, default=0.1)
    train.add_argument("--grad-clip", type=positive_float, default=1.0)
    train.add_argument("--eval-every", type=non_negative_int, default=250, metavar="N")
    train.add_argument("--save-every", type=non_negative_int, default=250, metavar="N")
    train.add_argument("--seed", type=int, default=0, metavar="S")
    train.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="torch threads (use 1 on a shared machine)")
    train.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    train.add_argument("--no-resume", action="store_true",
                       help="start over even if OUT/checkpoint exists")
    train.set_defaults(handler=_train)
