"""The trade-off task: the matched-cost rule by hand, bad configurations, and a small real run on
the embedded model whose numbers agree with the pieces they are made of."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval_harness.capability.task import capability_questions
from eval_harness.directions import TraitSteeringConfig, direction_bank, eval_pairs
from eval_harness.runner import run_task
from eval_harness.tradeoff.report import render_tradeoff
from eval_harness.tradeoff.task import TradeoffConfig, matched, run_tradeoff
from hf_memory import BankSet, MemoryMethod, Selector
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.calibration_data import direction_parts, oriented


def point(name, family, shift, cost, retention=1.0):
    return {"name": name, "family": family, "trait_shift": shift, "delta_nll": cost,
            "retention": retention}


def test_matched_cost_is_the_largest_shift_within_the_limit():
    points = [point("m1", "memory", 1.0, 0.02), point("m2", "memory", 3.0, 0.09, 0.8),
              point("m3", "memory", 5.0, 0.4), point("c1", "caa", 2.0, 0.11),
              point("p", "prompt", 0.5, -0.01)]
    assert matched(points, "memory", "delta_nll", 0.1)["name"] == "m2"
    assert matched(points, "memory", "retention", 0.9)["name"] == "m3"
    assert matched(points, "caa", "delta_nll", 0.1) is None  # CAA steers nothing there
    assert matched(points, "prompt", "delta_nll", 0.1)["name"] == "p"


@pytest.mark.parametrize("bad, message", [
    ({"memory_strengths": [0.0]}, "memory_strengths"), ({"caa_scales": [-1.0]}, "caa_scales"),
    ({"max_delta_nll": -0.1}, "max_delta_nll"), ({"min_retention": 1.5}, "min_retention"),
    ({"directions": ["X+"]}, "direction"), ({"passages": 0}, "passages")])
def test_bad_configurations_are_one_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        TradeoffConfig(**bad)


@pytest.mark.slow
def test_a_small_run_agrees_with_its_parts(default_model, monkeypatch, tmp_path):
    model, tokenizer = default_model
    selector = Selector(layers=[20], units={20: [0, 2]}, unit_type="kv_group",
                        layer_gains={20: 1.0}, candidate_layers=[20], strength=0.5)
    monkeypatch.setattr("eval_harness.directions.behavioural_selector",
                        lambda *args, **kwargs: selector)
    questions = capability_questions(1, 0)[:6]
    monkeypatch.setattr("eval_harness.capability.task.capability_questions",
                        lambda *args: questions)
    config = TradeoffConfig(directions=["N+"], memory_strengths=[0.5], caa_scales=[1.0],
                            passages=2, num_bootstrap=20)
    path = run_task("tradeoff", lambda: run_tradeoff(model, tokenizer, config), model=model,
                    config={"directions": ["N+"]}, seed=0, out=tmp_path / "run")
    results = json.loads(path.read_text())["results"]  # validated against the schema
    (direction,) = results["directions"]
    names = [p["name"] for p in direction["points"]]
    assert names == ["prompt", "memory@0.5", "caa×1"]  # the selector's own strength once
    assert direction["sites"]["selector_strength"] == 0.5
    # the memory point is the selector's sites at that strength, scored on the held-out pairs
    pairs = [oriented(i, 1) for i in eval_pairs() if i["trait"] == "N"]
    bank = direction_bank(model, tokenizer, direction_parts("N+")[2], "target", "persona",
                 TraitSteeringConfig(directions=["N+"]))
    method = MemoryMethod(BankSet([bank], model=model), layers=[20], units={20: [0, 2]},
                          unit_type="kv_group", layer_gains={20: 1.0}, strength=0.5)
    expected = (pair_margins(model, tokenizer, pairs, method=method)
                - pair_margins(model, tokenizer, pairs)).numpy()
    half = next(p for p in direction["points"] if p["name"] == "memory@0.5")
    assert half["trait_shift"] == pytest.approx(float(np.mean(expected)), abs=1e-6)
    assert direction["pairs"] == len(pairs) == 16
    for key, limit in (("delta_nll", 0.1), ("retention", 0.9)):
        row = direction["matched"][key]
        for family in ("memory", "caa", "prompt"):
            chosen = matched(direction["points"], family, key, limit)
            assert row[family] == (chosen["name"] if chosen else None)
            assert row["shift"][family] == pytest.approx(chosen["trait_shift"] if chosen
                                                         else 0.0)
        assert row["memory_minus_caa"] == pytest.approx(row["shift"]["memory"]
                                                        - row["shift"]["caa"])
    assert results["summary"]["delta_nll"]["directions"] == 1
    paths = render_tradeoff({"results": results, "model": {"name_or_path": "smol"}}, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "Shift at matched cost" in report and "memory@0.5" in report
    assert [p.name for p in paths] == ["report.md", "tradeoff_Nplus.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_every_task_of_the_command_line_may_write_a_results_file():
    import jsonschema

    from eval_harness.names import TASKS
    from eval_harness.runner import payload_schema, validate_results

    record = {"schema_version": 1, "created": "now", "wall_time_s": 0, "seed": 0,
              "environment": {"packages": {}, "git_sha": None, "python": "3", "platform": "x"},
              "model": {"model_type": "t", "name_or_path": "t", "num_hidden_layers": 1,
                        "weights_digest": "0"}, "config": {}, "results": {}}
    for task in TASKS:
        if payload_schema(task) is None:  # no results of its own to check here
            validate_results({**record, "task": task})
    with pytest.raises(jsonschema.ValidationError, match="is not one of"):
        validate_results({**record, "task": "no-such-task"})
