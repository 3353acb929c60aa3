"""Drift-adjusted steering score DAS = Δ_target − D_non-target (an ``evaluate`` metric)."""

from __future__ import annotations

import datasets
import evaluate

_DESCRIPTION = """
How much a steering method moved the target trait, net of how much it moved the others (the
memory-inception paper's DAS, section 4 and table 8). With steered trait scores s and plain
scores p over the same traits: Δ_target = s[target] - p[target]; D = mean over the other traits
of |s - p|; DAS = Δ_target - D.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `float`): trait scores under steering, one per trait.
    references (`list` of `float`): the plain model's trait scores, same order.
    traits (`list` of `str`): the trait names, same order.
    target (`str`): the trait the method steers towards.
Returns:
    delta_target, drift, das (floats).
Examples:
    >>> metric = DriftAdjustedScore()
    >>> result = metric.compute(predictions=[3.0, 4.0, 2.5, 4.7, 4.3],
    ...                         references=[3.5, 3.9, 2.8, 4.7, 2.0],
    ...                         traits=["O", "C", "E", "A", "N"], target="N")
    >>> {k: round(v, 3) for k, v in result.items()}
    {'delta_target': 2.3, 'drift': 0.225, 'das': 2.075}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class DriftAdjustedScore(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}))

    def _compute(self, predictions, references, traits, target):
        if len(traits) != len(predictions) or len(set(traits)) != len(traits):
            raise ValueError("traits must name each score once")
        if target not in traits:
            raise ValueError(f"target {target!r} is not one of {traits}")
        shifts = {t: s - p for t, s, p in zip(traits, predictions, references, strict=True)}
        others = [abs(v) for t, v in shifts.items() if t != target]
        if not others:
            raise ValueError("drift needs at least one non-target trait")
        drift = sum(others) / len(others)
        return {"delta_target": shifts[target], "drift": drift,
                "das": shifts[target] - drift}
