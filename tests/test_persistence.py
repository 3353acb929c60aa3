"""The persistence task: the opposite-style history, the context limit, and an end-to-end run
whose plain margins equal the likelihood probe's."""

from __future__ import annotations

import json
import shutil

import pytest

from eval_harness.directions import eval_pairs
from eval_harness.persistence.task import PersistenceConfig, opposite_history, run_persistence
from eval_harness.runner import validate_results
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.calibration_data import calibration_pairs
from tests.end_to_end import small_steering


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


def _tokens(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.slow
@pytest.mark.parametrize("length", [1, 300, 1500])
def test_history_is_the_shortest_cycle_prefix_reaching_the_length(tokenizer, length):
    history = opposite_history(tokenizer, "N+", length, 8192)
    assert _tokens(tokenizer, history) >= length
    assert len(history) == 2 or _tokens(tokenizer, history[:-2]) < length
    pairs, _ = calibration_pairs("N+", 24, 1)
    for i, (user, assistant) in enumerate(zip(history[0::2], history[1::2], strict=True)):
        prompt, _, opposite = pairs[i % len(pairs)]
        assert (user, assistant) == ({"role": "user", "content": prompt},
                                     {"role": "assistant", "content": opposite})
    assert opposite_history(tokenizer, "N+", 0, 8192) == []


@pytest.mark.slow
def test_a_history_beyond_the_context_is_refused(default_model, tokenizer):
    with pytest.raises(ValueError, match="does not fit the model's context"):
        opposite_history(tokenizer, "N+", 8192, 8192)
    model = default_model[0]
    config = PersistenceConfig(directions=["N+"],
                               lengths=[0, model.config.max_position_embeddings])
    with pytest.raises(ValueError, match="does not fit the model's context"):
        run_persistence(model, tokenizer, config)


@pytest.mark.parametrize("field, value, message", [
    ("directions", ["N*"], "directions must be among"),
    ("lengths", [0, -1], "lengths must be integers"),
    ("lengths", [], "lengths must be integers"),
    ("items", 0, "PersistenceConfig.items"),
])
def test_config_errors_name_the_problem(field, value, message):
    with pytest.raises(ValueError, match=message):
        PersistenceConfig(**{field: value})


@pytest.mark.slow
def test_persistence_end_to_end_on_the_embedded_model(default_model, tmp_path,
                                                     small_steering_selectors):
    from eval_harness.report import render_report
    from eval_harness.runner import run_task

    model, tokenizer = default_model
    tokenizer.padding_side = "left"
    config = PersistenceConfig(directions=["E+"], lengths=[0, 64], items=2, num_bootstrap=20)
    shutil.copytree(small_steering_selectors, tmp_path / "selectors")
    steering = small_steering(tmp_path / "selectors")
    path = run_task("persistence", lambda: run_persistence(model, tokenizer, config, steering),
                    model=model, config={"directions": ["E+"]}, seed=0, out=tmp_path)
    record = json.loads(path.read_text())
    validate_results(record)
    curves = record["results"]["curves"]
    assert [(c["length"], c["method"]) for c in curves] == [
        (n, m) for n in (0, 64) for m in ("plain", "prompt", "caa", "memory")]
    items = [i for i in eval_pairs() if i["trait"] == "E"][:2]
    probe = pair_margins(model, tokenizer, [(i["question"], i["high"], i["low"]) for i in items],
                         batch_size=config.batch_size).tolist()
    assert curves[0]["margins"] == probe  # the same batches: the same numbers
    for curve in curves:
        if curve["method"] == "plain":
            assert curve["shift"] == 0.0
        assert curve["shift_ci"][0] <= curve["shift"] <= curve["shift_ci"][1]
    assert curves[4]["history_tokens"] >= 64 and curves[0]["history_tokens"] == 0
    assert {p.name for p in render_report(path)} == {"report.md", "persistence.png"}
