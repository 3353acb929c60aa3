"""The persona A/B benchmark: the shipped compact sets and their converter, clear errors for bad
data and splits, disjoint seeded splits, propensities against hand-computed log-probabilities,
the steerability and matched-cost arithmetic, an end-to-end command-line run on a tiny model
whose numbers agree with the pieces they are made of, and the lm-eval tasks."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
import torch

from eval_harness.names import PERSONA_SETS
from eval_harness.persona_ab.convert import convert
from eval_harness.persona_ab.task import (
    ANSWERS,
    DATA_DIR,
    PersonaABConfig,
    caa_contrast_texts,
    default_caa_layers,
    least_squares_slopes,
    load_persona_set,
    matched_point,
    persona_prompts,
    propensities,
    split_items,
)
from hf_memory import PromptMethod
from hf_memory.chat.generation import chat_messages, default_system_prompt
from tests.tiny_models import tiny_model

PROMPTS = {"openness": {"positive_system_prompt": "You are open.",
                        "negative_system_prompt": "You are closed."}}
NEUTRAL = ["The river runs past the old mill.", "Seven plus five is twelve."]
ITEM = {"prompt": "Is the following statement something you would say?\n\"I like new ideas\"\n\n"
                  "Choices:\n(A):  No\n(B):  Yes", "positive": "(B)", "negative": "(A)"}


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny float64 Llama over the embedded model's tokenizer (vocabulary, chat template)."""
    return tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)


@pytest.fixture
def kept_environ():
    """The process environment as it was before the test (importing lm_eval sets
    ``HF_XET_HIGH_PERFORMANCE``)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def _data_dir(tmp_path, content: bytes, prompts=PROMPTS, name: str = "openness"):
    (tmp_path / "persona_prompts.json").write_text(json.dumps(prompts))
    (tmp_path / f"{name}.jsonl.gz").write_bytes(content)
    return tmp_path


def _hand_logprob(model, tokenizer, messages, reply: str) -> float:
    """log p(reply | messages) as the assistant's turn, from one unpadded forward pass."""
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head_ids = tokenizer(head, add_special_tokens=False).input_ids
    reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
    with torch.no_grad():
        logprobs = model(input_ids=torch.tensor([head_ids + reply_ids])).logits[0].log_softmax(-1)
    return sum(float(logprobs[len(head_ids) - 1 + i, t]) for i, t in enumerate(reply_ids))


def test_the_shipped_sets_are_steering_benchs_twelve_in_compact_form():
    assert sorted(persona_prompts()) == sorted(PERSONA_SETS)
    for name in PERSONA_SETS:
        items = load_persona_set(name)
        assert len(items) == 1000 and len({i["prompt"] for i in items}) == 1000
        assert sum(i["positive"] == "(A)" for i in items) == 500  # balanced, as the source
    shipped = sum(p.stat().st_size for p in DATA_DIR.iterdir())
    assert shipped < 400_000  # the source is 6.5 MB
    readme = (DATA_DIR / "README.md").read_text()
    assert "CC-BY-4.0" in readme and "MIT" in readme and "Perez et al." in readme


def test_the_converter_writes_deterministic_compact_files(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "persona_prompts.json").write_text(json.dumps(
        {**PROMPTS, "unused": PROMPTS["openness"]}))
    raw = [{"positive": {"prompt": ITEM["prompt"], "response": "(B)"},
            "negative": {"prompt": ITEM["prompt"], "response": "(A)"}, "meta": None,
            "steering_token_index": -2}] * 2
    (source / "openness.json").write_text(json.dumps(raw))
    first = convert(source, tmp_path / "a")
    second = convert(source, tmp_path / "b")
    assert [p.name for p in first] == ["openness.jsonl.gz", "persona_prompts.json"]
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert first[0].read_bytes()[4:8] == b"\0\0\0\0"  # gzip mtime 0
    assert load_persona_set("openness", tmp_path / "a") == [ITEM, ITEM]
    assert json.loads(first[1].read_text()) == PROMPTS  # only the converted sets' prompts
    (source / "openness.json").write_text(json.dumps([{**raw[0], "negative": {
        "prompt": ITEM["prompt"], "response": "(B)"}}]))
    with pytest.raises(ValueError, match=r"openness.json item 0: the answers must be \(A\) and"):
        convert(source, tmp_path / "c")


@pytest.mark.parametrize("content, message", [
    (b"not gzip at all", "is not a gzip'd UTF-8 JSON-lines file"),
    (gzip.compress(b"{not json\n"), "line 1 is not JSON"),
    (gzip.compress(json.dumps(ITEM).encode() + b"\n" + json.dumps(
        {**ITEM, "negative": "(B)"}).encode()), r"line 2: an item is"),
    (gzip.compress(json.dumps({"prompt": "x", "positive": "(A)"}).encode()), "line 1: an item"),
    (gzip.compress(b""), "holds no items"),
], ids=["not-gzip", "not-json", "same-answers", "missing-answer", "empty"])
def test_a_malformed_set_file_is_one_clear_error(tmp_path, content, message):
    with pytest.raises(ValueError, match=message) as error:
        load_persona_set("openness", _data_dir(tmp_path, content))
    assert error.value.__cause__ is None and "\n" not in str(error.value)  # one line


def test_a_set_without_persona_prompts_is_one_clear_error(tmp_path):
    good = gzip.compress(json.dumps(ITEM).encode() + b"\n")
    directory = _data_dir(tmp_path, good, prompts={"other": PROMPTS["openness"]})
    with pytest.raises(ValueError, match="persona set 'openness' has no positive and negative "
                                         "system prompt"):
        load_persona_set("openness", directory)
    with pytest.raises(ValueError, match=r"no persona set 'nope' in .* \(sets: openness\)"):
        load_persona_set("nope", directory)


def test_a_calibration_split_larger_than_the_set_is_one_clear_error():
    items = load_persona_set("openness")
    with pytest.raises(ValueError, match=r"calibration split \(1001 items\) is larger than the "
                                         r"set 'openness' \(1000 items\)"):
        split_items(items, 1001, 10, seed=0, name="openness")
    with pytest.raises(ValueError, match=r"\(900 \+ 200 items\) do not fit disjointly"):
        split_items(items, 900, 200, seed=0, name="openness")
    with pytest.raises(ValueError, match="held-out split needs a positive number"):
        split_items(items, 10, 0, seed=0, name="openness")


def test_splits_are_seeded_sized_and_disjoint():
    items = load_persona_set("risk-averse")
    calibration, heldout = split_items(items, 32, 200, seed=3, name="risk-averse")
    assert len(calibration) == 32 and len(heldout) == 200
    assert not set(calibration) & set(heldout)
    assert not {items[i]["prompt"] for i in calibration} & {items[i]["prompt"] for i in heldout}
    assert split_items(items, 32, 200, seed=3, name="risk-averse") == (calibration, heldout)
    assert split_items(items, 32, 200, seed=4, name="risk-averse")[0] != calibration
    assert split_items(items, 32, 200, seed=3, name="openness")[0] != calibration
    assert calibration != list(range(32))  # shuffled


def test_propensity_is_the_hand_computed_log_probability_difference(tiny, tokenizer):
    items = load_persona_set("neuroticism")[:3]
    text = persona_prompts()["neuroticism"]["positive_system_prompt"]
    method = PromptMethod(text, tokenizer=tokenizer)
    system = f"{default_system_prompt(tokenizer)}\n{text}"
    for chosen, messages in ((None, chat_messages), (method,
                                                     lambda p: chat_messages(p, system=system))):
        got = propensities(tiny, tokenizer, items, chosen, batch_size=2)
        want = [_hand_logprob(tiny, tokenizer, messages(i["prompt"]), i["positive"])
                - _hand_logprob(tiny, tokenizer, messages(i["prompt"]), i["negative"])
                for i in items]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
        assert np.abs(got).min() > 0  # the two answers differ on a random model too


def test_caa_contrast_ends_at_the_answer_letter(tokenizer):
    items = load_persona_set("openness")[:2]
    for item, (positive, negative) in zip(items, caa_contrast_texts(tokenizer, items),
                                          strict=True):
        for text, answer in ((positive, item["positive"]), (negative, item["negative"])):
            ids = tokenizer(text, add_special_tokens=False).input_ids
            assert tokenizer.decode(ids[-1]) == answer[1]  # "A" / "B": steering_token_index -2
            assert text.endswith(f"assistant\n{answer[:-1]}")
    assert default_caa_layers(30) == [10, 12, 15] and default_caa_layers(3) == [1]


def test_steerability_and_matched_cost_by_hand():
    values = np.array([[0.0, 1.0, 2.0], [1.0, 0.5, 0.0], [0.2, 0.2, 0.2]])
    slopes = least_squares_slopes([0.0, 0.5, 1.0], values)
    np.testing.assert_allclose(slopes, [np.polyfit([0, 0.5, 1], v, 1)[0] for v in values],
                               atol=1e-12)
    np.testing.assert_allclose(slopes.mean(), np.polyfit([0, 0.5, 1], values.mean(0), 1)[0])
    with pytest.raises(ValueError, match="two different dial values"):
        least_squares_slopes([1.0, 1.0], values[:, :2])
    points = [{"dial": 0.0, "shift": 0.0, "cost": 0.0}, {"dial": 0.5, "shift": 0.3, "cost": 0.05},
              {"dial": 1.0, "shift": 0.9, "cost": 0.2}]
    assert matched_point(points, 0.1)["dial"] == 0.5
    assert matched_point(points, 0.01)["dial"] == 0.0  # nothing steered fits: the plain model
    assert matched_point(points, 0.5)["dial"] == 1.0
    backwards = [points[0], {"dial": 1.0, "shift": -0.2, "cost": 0.05}]
    assert matched_point(backwards, 0.1)["shift"] == -0.2  # plain is no candidate


@pytest.mark.parametrize("bad, message", [
    ({"sets": ["nope"]}, "sets must be distinct names"), ({"sets": []}, "sets must be"),
    ({"dials": [1.5]}, "dials must be in"), ({"caa_scales": [0.0]}, "caa_scales"),
    ({"cost_budget": -1.0}, "cost_budget"), ({"heldout_items": 0}, "heldout_items"),
    ({"caa_layers": [-1]}, "caa_layers")])
def test_bad_configurations_are_one_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        PersonaABConfig(**bad)
    assert PersonaABConfig(dials=[0.25]).dials == [0.0, 0.25, 1.0]


@pytest.mark.slow
def test_the_command_line_runs_the_benchmark_and_its_numbers_add_up(tiny, tokenizer,
                                                                     monkeypatch, tmp_path):
    import hf_memory_cli as cli
    from hf_memory.metrics.steering_cost import NeutralCost

    monkeypatch.setattr("hf_memory_cli.evaluation.load_model",
                        lambda name, *args, **kwargs: (tiny, tokenizer))
    # two neutral passages instead of the shipped sixteen texts: the same measure, a fifth of
    # the time (the tiny model's cost is its 49k-word vocabulary's log-softmax)
    monkeypatch.setattr("eval_harness.persona_ab.task.NeutralCost",
                        lambda model, tokenizer, **kwargs: NeutralCost(
                            model, tokenizer, passages=NEUTRAL, **kwargs))
    out = tmp_path / "out"
    argv = ["eval", "persona-ab", "--sets", "openness,risk-averse", "--calibration-items", "3",
            "--heldout-items", "5", "--caa-layers", "1", "--bootstrap", "20", "--seed", "1",
            "--out", str(out)]
    assert cli.main(argv) == 0
    record = json.loads((out / "results.json").read_text())  # validated against the schemas
    results = record["results"]
    assert record["task"] == "persona-ab" and record["wall_time_s"] > 0
    assert [s["set"] for s in results["sets"]] == ["openness", "risk-averse"]
    assert results["config"]["top_layers"] == 3 and results["config"]["caa_layers"] == [1]
    assert results["cost_text"]["passages"] == len(NEUTRAL)
    entry = results["sets"][0]
    items = load_persona_set("openness")
    assert (entry["items"]["calibration"], entry["items"]["heldout"]) == split_items(
        items, 3, 5, seed=1, name="openness")
    held = [items[i] for i in entry["items"]["heldout"]]
    plain = propensities(tiny, tokenizer, held)
    assert entry["plain"]["mean_propensity"] == pytest.approx(plain.mean(), abs=1e-9)
    prompt = entry["methods"]["prompt"]["points"][1]
    positive = persona_prompts()["openness"]["positive_system_prompt"]
    steered = propensities(tiny, tokenizer, held, PromptMethod(positive, tokenizer=tokenizer))
    np.testing.assert_allclose(prompt["propensities"], steered, atol=1e-6)
    assert prompt["shift"] == pytest.approx((steered - plain).mean(), abs=1e-5)
    for method in ("prompt", "caa", "memory"):
        row = entry["methods"][method]
        points = row["points"]
        assert [p["dial"] for p in points] == ([0.0, 1.0] if method == "prompt"
                                               else [0.0, 0.5, 1.0])
        assert points[0]["shift"] == 0.0 and points[0]["cost"] == 0.0
        dials = [p["dial"] for p in points]
        means = [p["mean_propensity"] for p in points]
        assert row["steerability"] == pytest.approx(np.polyfit(dials, means, 1)[0], abs=1e-5)
        own = least_squares_slopes(dials, np.array([p["propensities"] for p in points]).T)
        assert row["wrong_way_fraction"] == pytest.approx((own < 0).mean())
        assert row["calibrated"]["shift"] == points[-1]["shift"]
        best = matched_point(points, 0.1)
        assert (row["matched"]["dial"], row["matched"]["shift"]) == (best["dial"], best["shift"])
        assert row["matched"]["fits"] == (best["dial"] > 0)
    summary = results["summary"]["prompt"]
    assert summary["shift"] == pytest.approx(np.mean(
        [s["methods"]["prompt"]["calibrated"]["shift"] for s in results["sets"]]))
    report = (out / "report.md").read_text()
    assert "Shift at matched cost" in report and "| openness | plain |" in report
    assert (out / "persona_ab.png").stat().st_size > 0
    # every finished set was saved as it went; a rerun resumes from there, computing nothing
    assert set(json.loads((out / "sets.partial.json").read_text())["sets"]) == {
        "openness", "risk-averse"}
    monkeypatch.setattr("eval_harness.persona_ab.task._score_set",
                        lambda *args, **kwargs: pytest.fail("a saved set was recomputed"))
    assert cli.main(argv) == 0
    again = json.loads((out / "results.json").read_text())["results"]
    assert again["sets"] == results["sets"] and results["resumed"] == []
    assert again["resumed"] == ["openness", "risk-averse"]
    assert again["sets_wall_time_s"] == results["sets_wall_time_s"] > 0
    assert "2 sets resumed from the checkpoint" in (out / "report.md").read_text()


def test_the_command_line_refuses_bad_input_in_one_line(capsys):
    import hf_memory_cli as cli

    with pytest.raises(SystemExit):
        cli.main(["eval", "persona-ab", "--sets", "openness,nope"])
    assert "choose from agreeableness" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", "persona-ab", "--heldout-items", "0"])
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_the_lm_eval_tasks_score_the_persona_answers(tiny, tokenizer, kept_environ):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from eval_harness.lm_eval_model.model import HFMemoryLM
    from eval_harness.lm_eval_model.task import run_lm_eval

    lm = HFMemoryLM(pretrained=tiny, tokenizer=tokenizer, batch_size=4)
    payload = run_lm_eval(lm, ["hfm_persona_ab"], limit=2)  # the group: all twelve sets
    tasks = {f"hfm_persona_{name.lower().replace('-', '_')}" for name in PERSONA_SETS}
    assert payload["samples"] == dict.fromkeys(tasks, 2)
    accuracies = [payload["results"][t]["acc,none"] for t in sorted(tasks)]
    assert payload["results"]["hfm_persona_ab"]["acc,none"] == pytest.approx(np.mean(accuracies))
    items = load_persona_set("openness")[:2]
    requests = [Instance("loglikelihood", {}, (f"{i['prompt']}\nAnswer:", f" {answer}"), k)
                for k, i in enumerate(items) for answer in ANSWERS]
    scores = [ll for ll, _ in lm.loglikelihood(requests)]
    by_hand = []  # the continuation's log-probability from one forward pass, token by token
    for request in requests:
        context, continuation = request.args
        head = tokenizer(context, add_special_tokens=False).input_ids
        tail = tokenizer(continuation, add_special_tokens=False).input_ids
        with torch.no_grad():
            logprobs = tiny(input_ids=torch.tensor([head + tail])).logits[0].log_softmax(-1)
        by_hand.append(sum(float(logprobs[len(head) - 1 + n, t]) for n, t in enumerate(tail)))
    np.testing.assert_allclose(scores, by_hand, rtol=0, atol=1e-6)
    positive = [scores[2 * k + ANSWERS.index(i["positive"])]
                > scores[2 * k + ANSWERS.index(i["negative"])] for k, i in enumerate(items)]
    assert payload["results"]["hfm_persona_openness"]["acc,none"] == pytest.approx(
        np.mean(positive))
