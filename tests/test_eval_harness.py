"""The evaluation harness: metrics, IPIP-50 items, DAS arithmetic, results schema, the CLI."""

from __future__ import annotations

import doctest
import importlib.util
import json

import jsonschema
import pytest

import hf_memory_cli as cli
from eval_harness.bigfive.task import (
    CALIBRATION_PROMPTS,
    TRAITS,
    item_prompt,
    load_items,
    summarize,
)
from eval_harness.metrics import METRICS_DIR, load_metric
from eval_harness.names import FACTORS
from eval_harness.report import render_report
from eval_harness.runner import environment, validate_results
from hf_memory.selection.selector import Selector


@pytest.mark.parametrize("name", ["big_five_traits", "drift_adjusted_score", "steering_shift"])
def test_metric_doctests_pass_and_cards_exist(name):
    path = METRICS_DIR / name / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"metric_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted >= 2 and result.failed == 0
    card = (METRICS_DIR / name / "README.md").read_text()
    assert card.startswith("---\ntitle:") and "evaluate.load" in card


def test_item_file_has_50_items_10_per_factor_both_keyings():
    data = json.loads((METRICS_DIR.parent / "bigfive" / "ipip50.json").read_text())
    assert "ipip.ori.org" in data["source"] and data["license"] == "public domain"
    items = load_items()
    assert len(items) == 50 and len({i["text"] for i in items}) == 50
    for factor in FACTORS:
        keys = [i["key"] for i in items if i["factor"] == factor]
        assert len(keys) == 10 and set(keys) == {1, -1}
    assert {i["factor"] for i in load_items(limit=2)} == set(FACTORS)
    assert len(load_items(limit=2)) == 10
    assert item_prompt(items[0]).startswith(
        'Here is a statement that may or may not describe you: "I am the life of the party."')
    assert set(TRAITS) == set(FACTORS) and len(CALIBRATION_PROMPTS) >= 5
    calibration = set(CALIBRATION_PROMPTS)
    assert not calibration & {item_prompt(i) for i in items}, "calibration must be held out"


def test_trait_scores_apply_reverse_keying():
    metric = load_metric("big_five_traits")
    scores = metric.compute(predictions=[5, 5, 1, 2, 4], references=[1, -1, -1, 1, -1],
                            factors=["N", "N", "E", "E", "O"])
    assert scores == {"E": 3.5, "N": 3.0, "O": 2.0}
    with pytest.raises(ValueError, match="in \\[1, 5\\]"):
        metric.compute(predictions=[6], references=[1], factors=["N"])


def test_das_and_drift_on_hand_made_answers():
    metric = load_metric("drift_adjusted_score")
    result = metric.compute(predictions=[3.0, 4.0, 2.0, 4.0, 4.5],
                            references=[3.0, 3.0, 3.0, 4.0, 2.5], traits=list(FACTORS),
                            target="N")
    assert result == {"delta_target": 2.0, "drift": 0.5, "das": 1.5}
    moved_away = metric.compute(predictions=[2.0, 3.0], references=[3.0, 3.0],
                                traits=["N", "E"], target="N")
    assert moved_away == {"delta_target": -1.0, "drift": 0.0, "das": -1.0}
    runs = [{"method": "plain"},
            {"method": "memory", "das": {k: result for k in ("greedy", "expected")}},
            {"method": "memory", "das": {k: moved_away for k in ("greedy", "expected")}}]
    assert summarize(runs)["memory"]["greedy"] == {"delta_target": 0.5, "drift": 0.25,
                                                   "das": 0.25}


def test_metric_loads_through_evaluate_offline():
    import evaluate

    metric = evaluate.load(str(METRICS_DIR / "drift_adjusted_score"))
    assert metric.compute(predictions=[1.0, 2.0], references=[0.0, 2.0], traits=["a", "b"],
                          target="a")["das"] == 1.0


def test_schema_rejects_incomplete_results():
    env = environment()
    assert set(env) == {"packages", "git_sha", "python", "platform"}
    assert env["packages"]["torch"]
    with pytest.raises(jsonschema.ValidationError):
        validate_results({"schema_version": 1, "task": "bigfive"})


def test_bad_task_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "bigfive", "--method", "plain,telepathy"])
    assert exit_info.value.code == 2
    assert "choose from plain, prompt, caa, memory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "trait-steering", "--calibration-pairs", "25"])
    assert exit_info.value.code == 2
    assert "must be between 1 and 24 pairs, got 25" in capsys.readouterr().err
    assert cli.main(["eval", "bigfive", "--model", "/nonexistent/model"]) == 2
    assert "cannot load model" in capsys.readouterr().err.strip().splitlines()[-1]
    assert cli.main(["report", "/nonexistent/results.json"]) == 2


@pytest.mark.slow
def test_bigfive_smoke_run_end_to_end(tmp_path, capsys):
    assert cli.main(["eval", "bigfive", "--limit", "2", "--traits", "N,E",
                     "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    validate_results(record)
    results = record["results"]
    assert record["task"] == "bigfive" and results["items"]["count"] == 10
    conditions = {(r["method"], r["target"]) for r in results["runs"]}
    assert conditions == {("plain", None)} | {(m, t) for m in ("prompt", "caa", "memory")
                                             for t in ("N", "E")}
    for run in results["runs"]:
        assert len(run["outputs"]) == 10
        for answer in run["outputs"]:
            assert answer["greedy"] in range(1, 6) and 1 <= answer["expected"] <= 5
            assert abs(sum(answer["probs"]) - 1) < 1e-4
    assert set(results["calibration"]["selectors"]) == {"N", "E"}
    assert (tmp_path / "report.md").is_file() and (tmp_path / "bigfive_das_greedy.png").is_file()
    assert "| **average** | memory |" in capsys.readouterr().out
    again = tmp_path / "again"
    render_report(tmp_path / "results.json", again)
    assert (again / "report.md").read_text() == (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_kv_footprint_task(tmp_path):
    assert cli.main(["eval", "kv-footprint", "--traits", "N", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    validate_results(record)
    target, both = record["results"]["rows"]
    assert target["bank_slots"] == target["prompt_tokens"] and target["controlled_layers"] == 5
    assert target["actual_ratio"] == pytest.approx(30 / 5)
    assert both["bank_bytes"] > target["bank_bytes"]
    assert (tmp_path / "kv_footprint.png").is_file()


def test_lexicon_judge_is_validated_and_scores_coherence():
    from eval_harness.judges import LexiconJudge, validate_judge

    judge = LexiconJudge()
    report = validate_judge(judge)
    assert report["accuracy"] >= 0.9, [r for r in report["rows"] if not r["correct"]]
    neutral = judge.judge("", "The train leaves at noon from platform four.")
    assert all(neutral[t] == 3.0 for t in FACTORS)
    fluent = judge.judge("", "I plan my week on Sunday and then I follow the schedule.")
    looping = judge.judge("", "I'm not sure. I'm not sure. I'm not sure. I'm not sure.")
    assert fluent["coherence"] > looping["coherence"] + 1.5
    assert 1.0 <= looping["coherence"] <= 5.0


def test_affect_lexicon_judge_beats_the_hand_lists_on_the_labelled_pairs():
    from eval_harness.judges import (
        AffectLexiconJudge,
        LexiconJudge,
        validate_judge,
        validate_judge_on_pairs,
    )

    affect, hand = AffectLexiconJudge(), LexiconJudge()
    assert validate_judge(affect)["accuracy"] >= 0.9
    ours, theirs = validate_judge_on_pairs(affect), validate_judge_on_pairs(hand)
    assert ours["pairs"] == 80
    for trait in ("N", "A"):  # the traits the NRC / VADER lexicons score
        assert ours["agreement"][trait] > theirs["agreement"][trait]
    for trait in ("O", "C", "E"):  # the hand lists, unchanged
        assert ours["agreement"][trait] == theirs["agreement"][trait]
    worried = affect.judge("", "I'm so afraid and sad, this is terrible.")
    calm = affect.judge("", "I feel calm, confident and happy.")
    assert worried["N"] > 3.0 > calm["N"] and calm["A"] > worried["A"]


def test_bigfive_generation_records_and_reports_repetition(default_model, tmp_path):
    from eval_harness.bigfive.generation import run_bigfive_generation
    from eval_harness.bigfive.task import BigFiveConfig
    from eval_harness.judges import LexiconJudge
    from eval_harness.runner import run_task
    from hf_memory.metrics.text_quality import repetition
    from tests.tiny_models import tiny_model

    tokenizer = default_model[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    config = BigFiveConfig(methods=["plain", "prompt", "memory"], traits=["N"], limit=2,
                           memory_layers=[1])
    path = run_task("bigfive-gen", lambda: run_bigfive_generation(
        model, tokenizer, config, judge=LexiconJudge(), max_new_tokens=6), model=model,
        config=vars(config), seed=0, out=tmp_path)
    results = json.loads(path.read_text())["results"]
    for run in results["runs"]:
        replies = [o["response"] for o in run["outputs"]]
        assert run["repetition"] == repetition(replies) and run["repetition"]["replies"] == 2
        assert results["repetition"][run["method"]] == run["repetition"]  # one target trait
    report = render_report(path, tmp_path / "report")[0].read_text()
    for run in results["runs"]:
        q = run["repetition"]
        assert (f"| {run['method']} | {run['target'] or '—'} | {run['coherence']:.2f} | "
                f"{q['distinct_2']:.2f} | {q['repeated_4gram']:.2f} |") in report


@pytest.mark.slow
def test_bigfive_generation_smoke_run(tmp_path):
    assert cli.main(["eval", "bigfive-gen", "--limit", "2", "--traits", "N",
                     "--method", "plain,prompt,memory", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    validate_results(record)
    runs = record["results"]["runs"]
    assert [(r["method"], r["target"]) for r in runs] == [
        ("plain", None), ("prompt", "N"), ("memory", "N")]
    for run in runs:
        assert len(run["outputs"]) == 2 and 1 <= run["coherence"] <= 5
        assert 0 <= run["repetition"]["repeated_4gram"] <= 1
        assert all(o["response"] for o in run["outputs"])
    assert set(record["results"]["summary"]) == {"prompt", "memory"}
    assert "Judge `nrc-vader-v1`" in (tmp_path / "report.md").read_text()
    compared = {j["judge"]: j for j in record["results"]["judges_compared"]}
    assert set(compared) == {"lexicon-v1", "nrc-vader-v1"}


@pytest.mark.slow
def test_trait_steering_smoke_run_end_to_end(tmp_path, capsys):
    assert cli.main(["eval", "trait-steering", "--directions", "N+", "--limit", "1",
                     "--candidate-layers", "19-20", "--calibration-pairs", "4",
                     "--top-layers", "1", "--bootstrap", "20", "--validation", "0.5",
                     "--cost-texts", "2", "--caa-scales", "1,4", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    validate_results(record)
    assert record["config"]["cost_texts"] == 2 and record["config"]["validation"] == 0.5
    assert record["config"]["caa_scales"] == [1.0, 4.0]
    saved = json.loads((tmp_path / "selectors" / "N+" / "selector.json").read_text())
    assert saved["config"]["validation_fraction"] == 0.5  # 2 of the 4 pairs held out
    assert saved["config"]["search_pairs"] == 2 and saved["config"]["validation"]["pairs"] == 2
    results = record["results"]
    assert results["items"] == {"likelihood": 5, "questionnaire": 5,
                                "source": results["items"]["source"]}
    methods = {r["method"] for r in results["runs"]}
    assert methods == {"prompt", "caa", "memory", "memory-diagnostic", "memory-neutral",
                       "memory-reference", "prompt-reference", "prompt-neutral"}
    memory = next(r for r in results["runs"] if r["method"] == "memory")
    low, high = memory["likelihood"]["target_shift_ci"]
    assert low <= memory["likelihood"]["target_shift"] <= high
    assert "acquiescence" in memory["questionnaire"]
    setup = results["setups"]["N+"]
    assert len(setup["memory"]["layers"]) == 1 and setup["memory"]["layers"][0] in (19, 20)
    # the largest-scoring scale within the cost budget, or 0 (CAA off) where none fits
    assert setup["caa"]["scale"] in (0.0, 1.0, 4.0)
    assert setup["memory"]["cost_budget"] == 0.1
    for masses in setup["memory"]["routing_mass"].values():
        assert sum(masses.values()) == pytest.approx(1.0, abs=1e-3)
    loaded = Selector.from_pretrained(tmp_path / "selectors" / "N+")
    assert loaded.layers == setup["memory"]["layers"]
    assert (tmp_path / "trait_steering_das.png").is_file()
    assert "| memory |" in capsys.readouterr().out
    # judged replies beside the likelihood: a judge fitted on the 4 calibration pairs, its
    # accuracy stated; where it is strong enough, every method's replies judged on the 1 question
    judged = setup["judged"]
    assert 0.0 <= judged["judge"]["held_out_accuracy"] <= 1.0 and judged["judge"]["pairs"] == 4
    report = (tmp_path / "report.md").read_text()
    assert "## Judged replies" in report
    if "refused" in judged:
        assert "held-out accuracy" in judged["refused"] and "(refused)" in report
    else:
        assert judged["questions"] == 1 and 0.0 <= judged["plain"]["judge_score"] <= 1.0
        for method in ("prompt", "caa", "memory"):
            run = next(r for r in results["runs"] if r["method"] == method)
            assert len(run["judged"]["replies"]) == 1
            assert 0.0 <= run["judged"]["judge_score"] <= 1.0


@pytest.mark.slow
def test_layer_ablation_smoke_run(tmp_path):
    assert cli.main(["eval", "layer-ablation", "--directions", "N-", "--limit", "1",
                     "--candidate-layers", "19-20", "--calibration-pairs", "4",
                     "--top-layers", "1", "--bootstrap", "20", "--cost-texts", "2",
                     "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    validate_results(record)
    (row,) = record["results"]["rows"]
    assert sorted(row["ranking"]) == [19, 20]
    assert [len(step["layers"]) for step in row["steps"]] == [1, 2]
    assert row["steps"][0]["bank_bytes"] * 2 == row["steps"][1]["bank_bytes"]
    assert row["prompt_kv_bytes"] > 0
    assert (tmp_path / "layer_ablation.png").is_file()
    assert "| N- | 2 | [19, 20] |" in (tmp_path / "report.md").read_text()
