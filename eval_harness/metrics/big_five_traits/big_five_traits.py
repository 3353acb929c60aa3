"""Big Five trait scores from Likert answers, with reverse keying (an ``evaluate`` metric)."""

from __future__ import annotations

import datasets
import evaluate

_DESCRIPTION = """
Mean rescored answer per Big Five factor. Each item's answer (1-5, or the expected value of the
answer distribution) is rescored as ``6 - answer`` when the item is reverse keyed (key -1), then
averaged over the factor's items.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `float`): the answers, 1 to 5 (fractional answers are allowed).
    references (`list` of `int`): each item's key, +1 or -1 (reverse keyed).
    factors (`list` of `str`): each item's factor, e.g. "O", "C", "E", "A", "N".
Returns:
    A dictionary from factor to its mean rescored answer.
Examples:
    >>> metric = BigFiveTraits()
    >>> metric.compute(predictions=[5, 1, 4, 2], references=[1, -1, 1, -1],
    ...                factors=["E", "E", "N", "N"])
    {'E': 5.0, 'N': 4.0}
    >>> metric.compute(predictions=[3.5], references=[-1], factors=["O"])
    {'O': 2.5}
"""

_CITATION = """
@article{goldberg1992,
  title={The development of markers for the Big-Five factor structure},
  author={Goldberg, Lewis R.},
  journal={Psychological Assessment}, volume={4}, pages={26--42}, year={1992}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BigFiveTraits(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references, factors):
        if len(factors) != len(predictions):
            raise ValueError(f"{len(factors)} factors for {len(predictions)} answers")
        totals: dict[str, list[float]] = {}
        for answer, key, factor in zip(predictions, references, factors, strict=True):
            if not 1 <= answer <= 5:
                raise ValueError(f"answers must lie in [1, 5], got {answer}")
            if key not in (1, -1):
                raise ValueError(f"keys must be +1 or -1, got {key}")
            totals.setdefault(factor, []).append(answer if key == 1 else 6 - answer)
        return {factor: sum(v) / len(v) for factor, v in sorted(totals.items())}
