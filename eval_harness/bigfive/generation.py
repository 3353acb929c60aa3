"""Big Five generation (memory-inception paper, appendix D.2) behind a pluggable judge.

Each method, steered towards a target trait, answers open-ended held-out prompts; the judge
scores every response on the five traits and coherence (1–5). Mean judged trait scores give
Δ_target, non-target drift and GAS = Δ_target − D against the plain model, through the same
``drift_adjusted_score`` metric as the questionnaire. Beside the judge, the responses'
repetition (:func:`~hf_memory.metrics.text_quality.repetition`: mean distinct-2 and repeated-4-gram
share) per run and per method over its target traits. The default judge is
:class:`~eval_harness.judges.AffectLexiconJudge`; the results carry its agreement (and the
hand-made lexicon judge's) on the labelled held-out trait pairs.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hf_memory import Method, generate_with
from hf_memory.metrics.text_quality import repetition

from ..judges import (
    AffectLexiconJudge,
    Judge,
    LexiconJudge,
    validate_judge,
    validate_judge_on_pairs,
)
from ..names import FACTORS
from .task import BigFiveConfig, run_conditions, summarize

__all__ = ["GENERATION_PROMPTS", "run_bigfive_generation"]

GENERATION_PROMPTS = (
    "Write a brief reply to a person feeling uncertain before an interview.",
    "Describe how you would spend a free Saturday.",
    "A friend forgot your birthday. What do you tell them?",
    "Give advice to someone starting a new job.",
    "How do you get ready for a long trip?",
    "Describe your ideal evening.",
)


def run_bigfive_generation(model, tokenizer, config: BigFiveConfig, *,
                           judge: Judge | None = None, max_new_tokens: int = 48,
                           prompts: tuple[str, ...] = GENERATION_PROMPTS) -> dict[str, Any]:
    """Generate, judge, and score every (target trait, method); return the task's results."""
    judge = judge or AffectLexiconJudge()
    prompts = prompts[: config.limit] if config.limit else prompts

    def generate_and_judge(method: Method):
        responses = generate_with(method, model, tokenizer, list(prompts),
                                  max_new_tokens=max_new_tokens)
        judged = [judge.judge(p, r) for p, r in zip(prompts, responses, strict=True)]
        outputs = [{"prompt": p, "response": r, "judgement": j}
                   for p, r, j in zip(prompts, responses, judged, strict=True)]
        return {"judge": {t: sum(j[t] for j in judged) / len(judged) for t in FACTORS}}, outputs

    runs, log = run_conditions(model, tokenizer, config, generate_and_judge, "bigfive-gen")
    for run in runs:
        run["coherence"] = (sum(o["judgement"]["coherence"] for o in run["outputs"])
                            / len(run["outputs"]))
        run["repetition"] = repetition([o["response"] for o in run["outputs"]])
    by_method = {run["method"]: [] for run in runs}
    for run in runs:
        by_method[run["method"]] += [o["response"] for o in run["outputs"]]
    pairs = validate_judge_on_pairs(judge)
    compared = [pairs] + [validate_judge_on_pairs(other)
                          for other in (LexiconJudge(), AffectLexiconJudge())
                          if other.name != judge.name]
    return {"runs": runs, "summary": summarize(runs), "calibration": log,
            "config": {k: v for k, v in asdict(config).items() if k != "extra"},
            "judge": {"name": judge.name, "validation": validate_judge(judge), "pairs": pairs},
            "judges_compared": compared,
            "repetition": {method: repetition(replies) for method, replies in by_method.items()},
            "items": {"source": "held-out open-ended prompts", "count": len(prompts)}}
