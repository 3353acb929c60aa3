"""The capability task: generated questions, option scoring against a direct computation, the
retention and ΔNLL bookkeeping, and an end-to-end run on the embedded model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eval_harness.capability.task import (
    CAPITALS,
    CapabilityConfig,
    capability_questions,
    run_capability,
    score_questions,
)
from eval_harness.runner import validate_results
from hf_memory.baselines.methods import PlainMethod, PromptMethod
from tests.end_to_end import small_steering


def test_questions_are_seeded_and_each_has_one_right_option():
    questions = capability_questions(12, seed=3)
    assert questions == capability_questions(12, seed=3)
    assert questions != capability_questions(12, seed=4)
    assert len(questions) == 12 + len(CAPITALS)
    capitals = dict(CAPITALS)
    for q in questions:
        assert len(set(q["options"])) == 4
        right = q["options"][q["answer"]]
        if q["kind"] == "arithmetic":
            a, b = (int(w) for w in q["question"].split("?")[0].split()[2::2])
            assert right == str(a + b)
        else:
            country = q["question"].removeprefix("What is the capital of ").split("?")[0]
            assert right == capitals[country]
    fewer = capability_questions(12, seed=3, capitals=5)
    assert fewer[:12] == questions[:12] and len(fewer) == 12 + 5
    assert [q["question"] for q in fewer[12:]] == [q["question"] for q in questions[12:17]]
    assert capability_questions(2, capitals=0) == capability_questions(2)[:2]
    for bad in (-1, len(CAPITALS) + 1, 2.0, True):
        with pytest.raises(ValueError, match="capitals must be an integer from 0 to 30"):
            capability_questions(2, capitals=bad)


def _direct_pick(model, tokenizer, question, system=None):
    """The option with the highest summed log-probability, one unpadded forward per option."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question["question"]}]
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head_ids = tokenizer(head, add_special_tokens=False).input_ids
    scores = []
    for option in question["options"]:
        reply = tokenizer(option, add_special_tokens=False).input_ids
        ids = torch.tensor([head_ids + reply])
        with torch.no_grad():
            logprobs = model(ids).logits[0, :-1].double().log_softmax(-1)
        positions = range(len(head_ids) - 1, len(head_ids) + len(reply) - 1)
        scores.append(sum(float(logprobs[p, t]) for p, t in zip(positions, reply, strict=True)))
    return max(range(len(scores)), key=scores.__getitem__)


@pytest.mark.slow
def test_option_scoring_equals_a_direct_computation(default_model):
    model, tokenizer = default_model
    tokenizer.padding_side = "left"
    questions = capability_questions(3, seed=0)[:3] + capability_questions(0, seed=0)[:3]
    picks = score_questions(model, tokenizer, questions, PlainMethod(), batch_size=5)
    assert picks == [_direct_pick(model, tokenizer, q) for q in questions]
    prompt = PromptMethod("You are a calm person.", tokenizer=tokenizer)
    picks = score_questions(model, tokenizer, questions, prompt, batch_size=7)
    assert picks == [_direct_pick(model, tokenizer, q, "You are a calm person.")
                     for q in questions]


@pytest.mark.parametrize("field, value, message", [
    ("directions", ["X+"], "directions must be among"),
    ("directions", [], "directions must be among"),
    ("additions", 0, "CapabilityConfig.additions"),
    ("passages", -1, "CapabilityConfig.passages"),
    ("capitals", 31, "capitals must be an integer from 0 to 30"),
    ("memory_gain_scales", (0.5,), "include 1.0"),
    ("memory_gain_scales", (1.0, float("nan")), "must be finite, > 0"),
])
def test_config_errors_name_the_problem(field, value, message):
    with pytest.raises(ValueError, match=message):
        CapabilityConfig(**{field: value})


@pytest.mark.slow
def test_capability_end_to_end_on_the_embedded_model(default_model, tmp_path,
                                                    small_steering_selectors):
    from eval_harness.report import render_report
    from eval_harness.runner import run_task

    model, tokenizer = default_model
    tokenizer.padding_side = "left"
    config = CapabilityConfig(directions=["E+"], additions=4, capitals=6, passages=3,
                              num_bootstrap=20,
                              selectors_dir=str(tmp_path / "selectors"),
                              memory_gain_scales=(0.5, 1.0))
    shutil.copytree(small_steering_selectors, tmp_path / "selectors")
    steering = small_steering(tmp_path / "selectors")
    path = run_task("capability", lambda: run_capability(model, tokenizer, config, steering),
                    model=model, config={"directions": ["E+"]}, seed=0, out=tmp_path)
    record = json.loads(path.read_text())
    validate_results(record)
    results = record["results"]
    assert [r["method"] for r in results["runs"]] == ["prompt", "caa", "memory", "memory×0.5"]
    kept = results["questions"]["kept"]
    assert 0 < kept <= 4 + 6
    for run in results["runs"]:
        low, high = run["retention_ci"]
        assert low <= run["retention"] <= high
        assert run["retention"] * kept == pytest.approx(round(run["retention"] * kept))
        low, high = run["delta_nll_ci"]
        assert low <= run["delta_nll"] <= high
        assert run["perplexity_ratio"] == pytest.approx(2.718281828459045 ** run["delta_nll"])
        low, high = run["trait_shift_ci"]
        assert low <= run["trait_shift"] <= high
    full, half = results["runs"][2], results["runs"][3]
    assert half["trait_shift"] != full["trait_shift"]
    assert set(results["summary"]) == {"prompt", "caa", "memory", "memory×0.5"}
    assert results["runs"][2]["setup"]["memory_layers"][0] in (19, 20)
    paths = render_report(path)
    assert {p.name for p in paths} == {"report.md", "capability.png"}
