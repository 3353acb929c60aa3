"""Target shift, drift and DAS from per-item scores, with paired bootstrap 95 % intervals (an
``evaluate`` metric)."""

from __future__ import annotations

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
How far a steering method moved the target trait, and how far it moved the others, from per-item
scores of the steered and the plain model on the same items (the memory-inception paper's
Δ_target, drift and DAS, section 4). A trait's score is the mean of its items' scores; when some
of its items are reverse keyed (key -1), it is the acquiescence-corrected score
(mean of agree-keyed − mean of reverse-keyed) / 2, so a method that makes the model agree with
everything does not look like a trait change. With per-trait changes δ = steered − plain:
target_shift = direction · δ[target]; drift = mean over the other traits of |δ|;
das = target_shift − drift. Intervals: percentile bootstrap over items, resampled within each
(trait, key) stratum and paired between steered and plain.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `float`): each item's score under steering (a log-prob margin, a
        Likert answer).
    references (`list` of `float`): the plain model's score of the same item.
    traits (`list` of `str`): each item's trait.
    target (`str`): the steered trait.
    direction (`int`): +1 to steer towards the trait, -1 away from it. Default 1.
    keys (`list` of `int`, optional): +1 / -1 per item (reverse keyed); default all +1.
    num_bootstrap (`int`): bootstrap resamples (default 1000; 0 skips the intervals).
    seed (`int`): bootstrap seed (default 0).
Returns:
    target_shift, drift, das (floats); with bootstrap, target_shift_ci, drift_ci, das_ci
    (`[low, high]`, 95 %).
Examples:
    >>> metric = SteeringShift()
    >>> result = metric.compute(predictions=[3.0, 1.0, 0.5, 0.5], references=[1.0, 0.0, 0.0, 1.0],
    ...                         traits=["N", "N", "E", "E"], target="N", num_bootstrap=0)
    >>> {k: round(v, 3) for k, v in result.items()}
    {'target_shift': 1.5, 'drift': 0.0, 'das': 1.5}
    >>> result = metric.compute(predictions=[4, 2, 3, 3], references=[3, 3, 3, 3],
    ...                         traits=["N", "N", "E", "E"], keys=[1, -1, 1, 1], target="N",
    ...                         direction=-1, num_bootstrap=0)
    >>> {k: round(v, 3) for k, v in result.items()}
    {'target_shift': -1.0, 'drift': 0.0, 'das': -1.0}
"""


def trait_scores(values: np.ndarray, traits: np.ndarray, keys: np.ndarray,
                 names: list[str]) -> np.ndarray:
    """``[..., n_traits]`` trait scores of ``values [..., items]`` (see the description)."""
    scores = []
    for name in names:
        agree, reverse = (traits == name) & (keys == 1), (traits == name) & (keys == -1)
        if reverse.any() and agree.any():
            scores.append((values[..., agree].mean(-1) - values[..., reverse].mean(-1)) / 2)
        elif agree.any():
            scores.append(values[..., agree].mean(-1))
        else:
            scores.append(-values[..., reverse].mean(-1))
    return np.stack(scores, axis=-1)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SteeringShift(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}))

    def _compute(self, predictions, references, traits, target, direction=1, keys=None,
                 num_bootstrap=1000, seed=0):
        steered, plain = np.asarray(predictions, float), np.asarray(references, float)
        traits = np.asarray(traits)
        keys = np.ones(len(steered), int) if keys is None else np.asarray(keys, int)
        if not len(traits) == len(keys) == len(steered):
            raise ValueError("one trait and one key per item")
        if not np.isfinite(steered).all() or not np.isfinite(plain).all():
            raise ValueError("scores must be finite")
        if direction not in (1, -1):
            raise ValueError(f"direction must be +1 or -1, got {direction}")
        if not set(keys.tolist()) <= {1, -1}:
            raise ValueError("keys must be +1 or -1")
        names = sorted(set(traits.tolist()))
        if target not in names or len(names) < 2:
            raise ValueError(f"target {target!r} must be one of at least two traits {names}")
        t = names.index(target)

        def summarise(index: np.ndarray) -> np.ndarray:
            delta = (trait_scores(steered[..., index], traits[index], keys[index], names)
                     - trait_scores(plain[..., index], traits[index], keys[index], names))
            shift = direction * delta[..., t]
            drift = np.abs(np.delete(delta, t, axis=-1)).mean(-1)
            return np.stack([shift, drift, shift - drift], axis=-1)

        point = summarise(np.arange(len(steered)))
        result = dict(zip(("target_shift", "drift", "das"), map(float, point), strict=True))
        if num_bootstrap:
            rng = np.random.default_rng(seed)
            strata = [np.flatnonzero((traits == n) & (keys == k)) for n in names for k in (1, -1)]
            strata = [s for s in strata if len(s)]
            draws = np.stack([summarise(np.concatenate([rng.choice(s, len(s)) for s in strata]))
                              for _ in range(num_bootstrap)])
            low, high = np.percentile(draws, [2.5, 97.5], axis=0)
            for i, name in enumerate(("target_shift", "drift", "das")):
                result[f"{name}_ci"] = [float(low[i]), float(high[i])]
        return result
