"""``--model`` for the commands that run a language model: the embedded default or any causal LM."""

from __future__ import annotations

import argparse

__all__ = ["add_model_arguments", "load_model"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--revision``."""
    parser.add_argument("--model", default="default", metavar="NAME",
                        help="'default' (the embedded SmolLM2-135M-Instruct), a local folder or "
                             "a Hub model id")
    parser.add_argument("--revision", metavar="REV",
                        help="with a Hub id: the branch, tag or commit to load")


def load_model(name: str, revision: str | None = None):
    """``(model, tokenizer)`` in eval mode, the tokenizer padding on the left."""
    from hf_memory import load_default_model

    if name == "default":
        if revision is not None:
            raise ValueError("--revision needs --model: the embedded model has no revisions")
        return load_default_model()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, revision=revision).eval()
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as error:  # no such folder / a folder of something else
        raise ValueError(f"cannot load model {name!r}: {str(error).splitlines()[0]}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
