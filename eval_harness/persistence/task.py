"""``persistence``: does steering hold when a long context pushes the other way (the paper's
D.6 / F.3 question, in a likelihood form)?

For a direction (say N+), the conversation first carries an **opposite-style history**: the
calibration questions of the trait (disjoint from every scored item) answered by the assistant in
the opposite pole's voice (the calm replies for N+), cycled until the history has at least
``length`` tokens under the chat template (0 = no history). Then each held-out item of the trait
(``data/trait_pairs.json``) is asked, and its margin log p(target reply) − log p(opposite reply)
is scored under

- ``plain``: no steering;
- ``prompt``: the target descriptor as a system message **once, at the start** (before the
  history), as a user would set it;
- ``caa`` and ``memory``: frozen exactly as ``trait-steering`` freezes them
  (:func:`~eval_harness.directions.calibrate_direction`), active over the whole
  conversation (CAA from the first position, like memory).

Reported per method and length: the mean oriented margin and its shift over plain at the same
length (with a 95 % bootstrap interval over items), as a curve against the history length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.recipes.calibration_data import calibration_pairs, direction_parts

from ..intervals import mean_interval
from ..names import check_positive_ints, checked_directions

__all__ = ["PersistenceConfig", "opposite_history", "run_persistence"]


@dataclass
class PersistenceConfig:
    """Knobs of the task (recorded in the results)."""

    directions: Sequence[str] = ("N+",)
    lengths: Sequence[int] = (0, 256, 1024, 2048)
    items: int = 8
    batch_size: int = 4
    num_bootstrap: int = 1000
    seed: int = 0
    selectors_dir: str | None = None

    def __post_init__(self) -> None:
        self.directions = checked_directions(self.directions)
        if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                   for n in self.lengths):
            raise ValueError(f"lengths must be integers >= 0, got {list(self.lengths)}")
        check_positive_ints(self, ("items", "batch_size", "num_bootstrap"))
        self.lengths = sorted(set(self.lengths))


def _tokens(tokenizer, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def opposite_history(tokenizer, direction: str, length: int,
                     context: int) -> list[dict[str, str]]:
    """User/assistant turns in the opposite pole's voice with at least ``length`` tokens (the
    shortest such prefix of the cycled calibration turns; ``[]`` for 0).

    Raises:
        ValueError: ``length`` does not leave room in a model ``context`` tokens long.
    """
    if length >= context:
        raise ValueError(f"a history of {length} tokens does not fit the model's context of "
                         f"{context} tokens")
    if length == 0:
        return []
    _, sign, _, _ = direction_parts(direction)
    pairs, _ = calibration_pairs(direction, 24, 1)
    history: list[dict[str, str]] = []
    while True:
        for prompt, _, opposite in pairs:
            history += [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": opposite}]
            if _tokens(tokenizer, history) >= length:
                return history


def run_persistence(model, tokenizer, config: PersistenceConfig,
                    steering=None) -> dict[str, Any]:
    """The margin-vs-history-length curves of plain, prompt, CAA and memory (module docstring).
    ``steering``: the ``TraitSteeringConfig`` the methods are frozen under (default:
    trait-steering's)."""
    from ..directions import TraitSteeringConfig, calibrate_direction, eval_pairs

    context = model.config.max_position_embeddings
    if max(config.lengths) >= context:
        raise ValueError(f"a history of {max(config.lengths)} tokens does not fit the model's "
                         f"context of {context} tokens")
    if steering is None:
        steering = TraitSteeringConfig(directions=config.directions,
                                       batch_size=config.batch_size,
                                       selectors_dir=config.selectors_dir, seed=config.seed)
    curves, setups = [], {}
    for direction in tqdm(config.directions, desc="persistence"):
        trait, sign, target, _ = direction_parts(direction)
        items = [i for i in eval_pairs() if i["trait"] == trait][:config.items]
        frozen = calibrate_direction(model, tokenizer, direction, steering)
        setups[direction] = {"caa_scale": frozen.setup["caa"]["scale"],
                             "memory_layers": frozen.setup["memory"]["layers"],
                             "prompt": target}
        methods = {"plain": None, "prompt": None, "caa": frozen.methods["caa"],
                   "memory": frozen.methods["memory"]}
        for length in config.lengths:
            history = opposite_history(tokenizer, direction, length, context)
            margins = {}
            for name, method in methods.items():
                system = [{"role": "system", "content": target}] if name == "prompt" else []
                conversations, replies = [], []
                for item in items:
                    question, wanted, opposite = ((item["question"], item["high"], item["low"])
                                                  if sign > 0 else
                                                  (item["question"], item["low"], item["high"]))
                    turn = system + history + [{"role": "user", "content": question}]
                    conversations += [turn, turn]
                    replies += [wanted, opposite]
                scores = reply_logprobs(model, tokenizer, conversations, replies, method=method,
                                        batch_size=config.batch_size).numpy()
                margins[name] = scores[0::2] - scores[1::2]
            history_tokens = _tokens(tokenizer, history) if history else 0
            for name, values in margins.items():
                shift = values - margins["plain"]
                curves.append({
                    "direction": direction, "method": name, "length": length,
                    "history_tokens": history_tokens, "history_turns": len(history) // 2,
                    "margin": float(values.mean()), "shift": float(shift.mean()),
                    "shift_ci": mean_interval(shift, config.num_bootstrap, config.seed),
                    "margins": values.tolist()})
    return {"curves": curves, "setups": setups, "config": asdict(config),
            "steering": {k: v for k, v in asdict(steering).items() if k != "extra"}}
