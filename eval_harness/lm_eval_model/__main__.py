"""``python -m eval_harness.lm_eval_model --model hf-memory --model_args ... --tasks ...``:
lm-eval's own command line with the ``hf-memory`` model type registered."""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

from . import model  # noqa: F401  (registers "hf-memory")

if __name__ == "__main__":
    cli_evaluate()
