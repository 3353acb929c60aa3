"""``hf-memory eval air-sudoku | air-maze | arith-splits`` on models a user points at."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import hf_memory_cli as cli
from eval_harness.runner import validate_results
from modeling.air import AIRConfig, AIRSolver, sudoku_dataset
from modeling.air.maze_air import MAZE_VOCAB_SIZE
from modeling.air.training_air import evaluate_air
from modeling.arith import ArithConfig, ArithTransformer


def _air(tmp_path, vocab: int, seq_len: int):
    torch.manual_seed(0)
    model = AIRSolver(AIRConfig(vocab_size=vocab, seq_len=seq_len, hidden_size=16,
                                num_hidden_layers=1, num_attention_heads=2, halt_max_steps=2))
    model.save_pretrained(tmp_path / "model")
    return model


def _run(argv, capsys) -> dict:
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "report.md" in out
    out_dir = Path(argv[argv.index("--out") + 1])
    record = json.loads((out_dir / "results.json").read_text())
    validate_results(record)
    return record


def test_air_sudoku_scores_held_out_puzzles_like_evaluate_air(tmp_path, capsys):
    model = _air(tmp_path, vocab=6, seq_len=16).eval()
    record = _run(["eval", "air-sudoku", "--model", str(tmp_path / "model"), "--puzzles", "12",
                   "--seed", "4", "--out", str(tmp_path / "res")], capsys)
    assert record["model"]["model_type"] == "air" and record["environment"]["device"] == "cpu"
    assert record["model"]["revision"] is None
    expected = evaluate_air(model, sudoku_dataset(4, 12, "test", seed=4), "sudoku")
    assert record["results"]["metrics"] == pytest.approx(expected)
    assert record["results"]["puzzles"] == 12 and record["results"]["board_size"] == 4
    assert (tmp_path / "res" / "metrics.png").is_file()
    assert "exact_accuracy" in (tmp_path / "res" / "report.md").read_text()


def test_air_maze_reports_valid_optimal_accuracy(tmp_path, capsys):
    _air(tmp_path, vocab=MAZE_VOCAB_SIZE, seq_len=36)
    record = _run(["eval", "air-maze", "--model", str(tmp_path / "model"), "--puzzles", "4",
                   "--out", str(tmp_path / "res")], capsys)
    assert 0.0 <= record["results"]["metrics"]["valid_optimal_accuracy"] <= 1.0


def test_arith_splits_scores_every_pool_and_the_progress_measures(tmp_path, capsys):
    torch.manual_seed(0)
    ArithTransformer(ArithConfig(hidden_size=16, head_dim=8, intermediate_size=16)
                     ).save_pretrained(tmp_path / "model")
    record = _run(["eval", "arith-splits", "--model", str(tmp_path / "model"), "--pool-size",
                   "64", "--out", str(tmp_path / "res")], capsys)
    metrics = record["results"]["metrics"]
    assert {"0var/train", "1var/train", "2var/train"} <= set(metrics)
    assert any("held_out" in name for name in metrics)
    assert all(0.0 <= v <= 1.0 for v in metrics.values())
    assert "ov2_mlp2_accuracy" in record["results"]["progress"]


@pytest.mark.parametrize("argv, message", [
    (["eval", "air-sudoku"], "needs --model"),
    (["eval", "arith-splits", "--model", "{air}"], "needs an arith model"),
    (["eval", "air-maze", "--model", "{tmp}/missing"], "cannot load model"),
], ids=["no-model", "wrong-family", "missing"])
def test_family_tasks_refuse_the_wrong_model_in_one_line(argv, message, tmp_path, capsys):
    _air(tmp_path, vocab=6, seq_len=16)
    argv = [a.format(air=tmp_path / "model", tmp=tmp_path) for a in argv]
    assert cli.main([*argv, "--out", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in err and message in err
    assert not (tmp_path / "res").exists()


def test_card_from_results_holds_every_metric_in_its_model_index(tmp_path, capsys):
    from huggingface_hub import ModelCard

    _air(tmp_path, vocab=6, seq_len=16)
    (tmp_path / "log.json").write_text(json.dumps({"train_config": {"steps": 6, "lr": 1e-3},
                                                   "final": {"wall_time_s": 12.0}}))
    record = _run(["eval", "air-sudoku", "--model", str(tmp_path / "model"), "--puzzles", "8",
                   "--out", str(tmp_path / "res")], capsys)
    assert cli.main(["card", str(tmp_path / "model"), "--results", str(tmp_path / "res")]) == 0
    card = ModelCard.load(tmp_path / "model" / "README.md")
    measured = {r.metric_type: r.metric_value for r in card.data.eval_results}
    expected = {k: round(v, 4) for k, v in record["results"]["metrics"].items()
                if k not in ("count", "mean_segments", "tokens")}
    assert measured == expected
    assert card.data.license == "apache-2.0" and "air" in card.data.tags
    assert card.data.datasets == ["hf-memory/sudoku-offline"]
    assert "hf-memory eval air-sudoku" in card.text and "| `steps` | 6 |" in card.text
    assert "Intended use and limitations" in card.text


def test_card_refuses_results_of_another_checkpoint(tmp_path, capsys):
    _air(tmp_path, vocab=6, seq_len=16)
    _run(["eval", "air-sudoku", "--model", str(tmp_path / "model"), "--puzzles", "4",
          "--out", str(tmp_path / "res")], capsys)
    torch.manual_seed(1)
    AIRSolver(AIRConfig(vocab_size=6, seq_len=16, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, halt_max_steps=2)).save_pretrained(tmp_path / "b")
    assert cli.main(["card", str(tmp_path / "b"), "--results", str(tmp_path / "res")]) == 2
    assert "measured on another checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "b" / "README.md").exists()


@pytest.mark.slow
def test_asm_lm_perplexity_geometry_report_and_card(tmp_path, capsys):
    from huggingface_hub import ModelCard
    from transformers import AutoTokenizer

    from hf_memory.models import default_model as dm
    from modeling.asm import ASMConfig, ASMForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(dm.ensure_default_model_cached())
    torch.manual_seed(0)
    ASMForCausalLM(ASMConfig(vocab_size=len(tokenizer), hidden_size=24, num_hidden_layers=2,
                             num_attention_heads=3, num_slots=4, slot_space_dim=6)
                   ).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    record = _run(["eval", "asm-lm", "--model", str(tmp_path / "model"), "--sentences", "6",
                   "--out", str(tmp_path / "res")], capsys)
    metrics = record["results"]["metrics"]
    # an untrained model is close to uniform over the vocabulary
    assert abs(metrics["nll_per_token"] - torch.log(torch.tensor(len(tokenizer))).item()) < 1.0
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["nll_per_token"]), rel=1e-9)
    geometry = record["results"]["geometry"]
    assert set(geometry) == {"alpha", "orthogonal_fraction", "relative_magnitude", "slot_ess",
                             "routing_inertia"} and all(len(v) == 2 for v in geometry.values())
    assert all(1.0 <= e <= 4.0 + 1e-6 for e in geometry["slot_ess"])
    assert (tmp_path / "res" / "geometry.png").is_file()
    assert cli.main(["card", str(tmp_path / "model"), "--results", str(tmp_path / "res")]) == 0
    card = ModelCard.load(tmp_path / "model" / "README.md")
    assert {r.metric_type for r in card.data.eval_results} == {"perplexity", "nll_per_token"}


def test_a_suite_runs_every_entry_and_compares_models_side_by_side(tmp_path, capsys):
    _air(tmp_path, vocab=6, seq_len=16)
    torch.manual_seed(1)
    AIRSolver(AIRConfig(vocab_size=6, seq_len=16, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, halt_max_steps=2)).save_pretrained(tmp_path / "b")
    torch.manual_seed(0)
    ArithTransformer(ArithConfig(hidden_size=16, head_dim=8, intermediate_size=16)
                     ).save_pretrained(tmp_path / "arith")
    (tmp_path / "suite.yaml").write_text(
        "runs:\n"
        f"  - {{task: air-sudoku, model: {tmp_path / 'model'}, args: {{puzzles: 6}}}}\n"
        f"  - {{task: air-sudoku, model: {tmp_path / 'b'}, args: {{puzzles: 6}}}}\n"
        f"  - {{task: arith-splits, model: {tmp_path / 'arith'}, args: {{pool_size: 32}}}}\n")
    assert cli.main(["eval", "--suite", str(tmp_path / "suite.yaml"), "--out",
                     str(tmp_path / "suite")]) == 0
    report = (tmp_path / "suite" / "suite.md").read_text()
    assert report.count("\n| ") >= 2 + 2 + 1 + 1  # two tables: header row + model rows
    assert "## air-sudoku" in report and "## arith-splits" in report
    assert str(tmp_path / "b") in report and (tmp_path / "suite" / "suite.png").is_file()
    assert len(list((tmp_path / "suite").glob("*/results.json"))) == 3
    assert "suite 3/3" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ("runs: 3", "needs a list 'runs'"),
    ("runs: [{model: x}]", "needs a list 'runs'"),
    ("runs: [: :", "not valid YAML"),
], ids=["not-a-list", "no-task", "bad-yaml"])
def test_bad_suite_files_are_one_line(text, message, tmp_path, capsys):
    (tmp_path / "suite.yaml").write_text(text)
    assert cli.main(["eval", "--suite", str(tmp_path / "suite.yaml"), "--out",
                     str(tmp_path / "suite")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "suite").exists()


def test_payload_schemas_reject_a_broken_payload(tmp_path, capsys):
    import jsonschema

    _air(tmp_path, vocab=6, seq_len=16)
    record = _run(["eval", "air-sudoku", "--model", str(tmp_path / "model"), "--puzzles", "4",
                   "--out", str(tmp_path / "res")], capsys)
    record["results"]["metrics"]["exact_accuracy"] = 1.5
    with pytest.raises(jsonschema.ValidationError, match="1.5"):
        validate_results(record)
    del record["results"]["board_size"]
    with pytest.raises(jsonschema.ValidationError, match="board_size"):
        validate_results(record)
