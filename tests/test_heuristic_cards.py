"""The HARDMath / PHYSICS harness: boxed-answer extraction and grading, problem loading with the
user's field names, and the three methods run on a tiny model."""

from __future__ import annotations

import json

import pytest

from eval_harness.heuristic_cards.task import (
    CARDS,
    BoxedAnswerGrader,
    extract_boxed,
    load_problems,
    run_heuristic_cards,
)
from hf_memory.metrics.text_quality import repetition
from tests.tiny_models import tiny_model


@pytest.mark.parametrize(("text", "boxed"), [
    ("so \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{20}}", "\\frac{1}{20}"),
    ("\\boxed{e^{-x^{2}}}", "e^{-x^{2}}"),
    ("no box here", None),
    ("\\boxed{unclosed", None),
])
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize(("reply", "reference", "points"), [
    ("\\boxed{\\frac{1}{20}}", "0.05", 1.0),  # the paper's example of a brittle scorer
    ("\\boxed{1/20}", "0.05", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{x^2 + 1}", "x^{2}+1", 0.0),  # no symbolic equivalence: an honest limit
    ("\\boxed{ x^2+1 }", "x^2+1", 1.0),
    ("\\boxed{\\sqrt{\\pi/x}}", "\\sqrt{\\pi/x}, e^{-x}", 0.5),  # one of two asymptotes
    ("\\boxed{0.06}", "0.05", 0.0),
    ("0.05", "0.05", 0.0),  # no boxed answer
])
def test_grader_points(reply, reference, points):
    assert BoxedAnswerGrader().grade(reply, reference) == points


def test_problems_load_with_the_users_field_names(tmp_path):
    rows = [{"problem": "Find x.", "solution": "2", "type": "ode"},
            {"problem": "Find y.", "solution": "3", "type": "integral"}]
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for name in ("p.json", "p.jsonl"):
        problems = load_problems(tmp_path / name, question_field="problem",
                                 answer_field="solution", category_field="type")
        assert problems == [{"question": "Find x.", "answer": "2", "category": "ode"},
                            {"question": "Find y.", "answer": "3", "category": "integral"}]
    with pytest.raises(ValueError, match="problem 0 of .* lacks question"):
        load_problems(tmp_path / "p.json")
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_problems(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read problems"):
        load_problems(tmp_path / "missing.jsonl")


def test_the_three_methods_run_and_are_graded(default_model):
    tokenizer = default_model[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    problems = [{"question": "Solve y' = y with y(0) = 1; give y(1).", "answer": "2.718281828",
                 "category": "ode"},
                {"question": "Find the roots of x^2 - 1.", "answer": "1, -1",
                 "category": "polynomial_roots"}]
    result = run_heuristic_cards(model, tokenizer, problems, CARDS["hardmath"], layers=[1, 2],
                                 gain=2.0, max_new_tokens=4)
    assert set(result["scores"]) == {"ode", "polynomial_roots"}
    assert all(set(v) == {"plain", "prompt", "memory"} for v in result["scores"].values())
    assert len(result["rows"]) == 6 and all(r["points"] in (0.0, 0.5, 1.0)
                                            for r in result["rows"])
    for category, methods in result["repetition"].items():  # beside the grade
        assert set(methods) == {"plain", "prompt", "memory"}
        for method, quality in methods.items():
            assert quality == repetition([r["reply"] for r in result["rows"]
                                          if (r["category"], r["method"]) == (category, method)])
    with pytest.raises(ValueError, match="no card for the categories \\['topology'\\]"):
        run_heuristic_cards(model, tokenizer, [{**problems[0], "category": "topology"}],
                            CARDS["hardmath"], layers=[1])
    with pytest.raises(ValueError, match="give the memory sites"):
        run_heuristic_cards(model, tokenizer, problems, CARDS["hardmath"])


def test_cards_are_process_only():
    for benchmark, cards in CARDS.items():
        assert cards, benchmark
        for card in cards.values():
            assert 100 < len(card) < 400 and "\\boxed" not in card and "=" not in card
