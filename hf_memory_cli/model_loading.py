"""``--model`` for the commands that run a language model: the embedded default or any causal LM."""

from __future__ import annotations

import argparse

from .errors import CLIError

__all__ = ["add_model_arguments", "load_model"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--revision``."""
    parser.add_argument("--model", default="default", metavar="NAME",
                        help="'default' (the embedded SmolLM2-135M-Instruct), another embedded "
                             "model (gemma3-270m, an optional extra), a local folder or a Hub "
                             "model id")
    parser.add_argument("--revision", metavar="REV",
                        help="with a Hub id: the branch, tag or commit to load")


def load_model(name: str, revision: str | None = None):
    """``(model, tokenizer)`` in eval mode, the tokenizer padding on the left: ``"default"`` or
    another embedded model by name (:mod:`hf_memory.models.embedded`), else a folder or Hub id."""
    from hf_memory.models.embedded import (
        EMBEDDED_MODELS,
        EmbeddedModelUnavailableError,
        load_embedded_model,
    )

    if name == "default" or name in EMBEDDED_MODELS:
        if revision is not None:
            raise ValueError(f"--revision is for Hub models: the embedded {name!r} has none")
        try:
            return load_embedded_model("smollm2-135m-instruct" if name == "default" else name)
        except EmbeddedModelUnavailableError as error:
            raise CLIError(str(error)) from error
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
