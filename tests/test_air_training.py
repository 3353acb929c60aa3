"""AIR training loop: the carry crosses batches, logs and checkpoints agree, errors are named."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel

from hub_cards.air_card import render_air_card
from modeling.air import AIRConfig, AIRSolver, maze_dataset_dict, sudoku_dataset
from modeling.air.maze_air import MAZE_VOCAB_SIZE, valid_optimal_accuracy
from modeling.air.training_air import AIRTrainConfig, evaluate_air, train_air


@pytest.fixture(scope="module")
def sudoku4():
    return (sudoku_dataset(4, 96, "train", seed=3), sudoku_dataset(4, 32, "test", seed=3))


def tiny_solver(vocab: int = 6, seq_len: int = 16, **overrides) -> AIRSolver:
    fields = dict(vocab_size=vocab, seq_len=seq_len, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=2, halt_max_steps=3)
    fields.update(overrides)
    torch.manual_seed(0)
    return AIRSolver(AIRConfig(**fields))


def quick(**overrides) -> AIRTrainConfig:
    fields = dict(steps=6, batch_size=16, lr=1e-3, warmup_steps=2, weight_decay=0.1,
                  eval_every=3, eval_batch_size=64, progress=False, threads=1, cpu=True)
    fields.update(overrides)
    return AIRTrainConfig(**fields)


def test_the_carry_returned_by_one_step_is_fed_to_the_next(sudoku4):
    train, test = sudoku4
    model = tiny_solver()
    seen = []
    model.register_forward_hook(
        lambda module, args, kwargs, output: seen.append((kwargs["carry"], output.carry)),
        with_kwargs=True)
    train_air(model, train, None, quick())
    assert seen[0][0] is None
    for (_, produced), (received, _) in zip(seen, seen[1:], strict=False):
        assert received is produced
    # rows that did not halt keep their puzzle although the next batch brought another one
    assert any((~carry.halted).any() for _, carry in seen[:-1])


def test_log_checkpoint_and_evaluation_agree(sudoku4, tmp_path):
    train, test = sudoku4
    log = train_air(tiny_solver(), train, test, quick(ema_decay=0.9), out=tmp_path)
    assert [entry["step"] for entry in log["history"]] == [3, 6]
    on_disk = json.loads((tmp_path / "log.json").read_text())
    assert on_disk["final"] == log["final"] and on_disk["train_size"] == len(train)
    for key in ("loss", "lm_loss", "q_halt_loss", "q_continue_loss", "halted_fraction"):
        assert key in log["final"]
    final = AutoModel.from_pretrained(tmp_path / "final")  # the EMA weights evaluated last
    again = evaluate_air(final, test, "sudoku", batch_size=64)
    assert again == log["final"]["eval"]


def test_evaluation_scores_match_a_direct_solve(sudoku4):
    _, test = sudoku4
    model = tiny_solver().eval()
    metrics = evaluate_air(model, test, "sudoku", batch_size=7, max_segments=2)
    ids = torch.tensor(test["inputs"])
    labels = torch.tensor(test["labels"])
    solution = model.solve(ids, max_segments=2)
    right = solution.predictions == labels
    assert metrics["count"] == len(test)
    assert metrics["exact_accuracy"] == pytest.approx(right.all(-1).float().mean().item())
    assert metrics["token_accuracy"] == pytest.approx(right.float().mean().item())
    assert metrics["mean_segments"] == 2


def test_maze_evaluation_reports_valid_and_optimal_paths():
    splits = maze_dataset_dict(6, 8, 8, seed=0, min_path_length=6)
    model = tiny_solver(vocab=MAZE_VOCAB_SIZE, seq_len=36).eval()
    metrics = evaluate_air(model, splits["test"], "maze", max_segments=1)
    predictions = model.solve(torch.tensor(splits["test"]["inputs"]), max_segments=1).predictions
    expected = valid_optimal_accuracy(splits["test"]["inputs"], predictions.numpy(), 6)
    assert metrics["valid_optimal_accuracy"] == expected
    # the labels themselves are valid optimal paths
    assert valid_optimal_accuracy(splits["test"]["inputs"], splits["test"]["labels"], 6) == 1.0


def test_training_learns_on_a_fixed_seed(sudoku4):
    train, test = sudoku4
    model = tiny_solver()
    before = evaluate_air(model, test, "sudoku")["token_accuracy"]
    log = train_air(model, train, test, quick(steps=60, eval_every=0, lr=3e-3, warmup_steps=5))
    assert log["history"][-1]["eval"]["token_accuracy"] > before + 0.15


def test_bad_datasets_and_settings_are_named(sudoku4):
    train, _ = sudoku4
    with pytest.raises(ValueError, match="seq_len"):
        train_air(tiny_solver(seq_len=81, vocab=11), train, None, quick())
    with pytest.raises(ValueError, match="lacks the column"):
        train_air(tiny_solver(), train.remove_columns("labels"), None, quick())
    with pytest.raises(ValueError, match="empty"):
        train_air(tiny_solver(), train.select([]), None, quick())
    with pytest.raises(ValueError, match="task"):
        AIRTrainConfig(task="chess")
    with pytest.raises(ValueError, match="batch_size"):
        AIRTrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="lr"):
        AIRTrainConfig(lr=float("nan"))


def test_a_diverging_run_stops_with_a_clear_error(sudoku4):
    train, _ = sudoku4
    model = tiny_solver()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="step 1"):
        train_air(model, train, None, quick())


def test_air_train_and_air_report_from_the_command_line(tmp_path, capsys):
    import hf_memory_cli as cli

    out = tmp_path / "run"
    argv = ["air-train", "--out", str(out), "--size", "4", "--train-puzzles", "32",
            "--test-puzzles", "16", "--steps", "4", "--batch-size", "8", "--hidden-size", "16",
            "--heads", "2", "--layers", "1", "--halt-max-steps", "2", "--eval-every", "2",
            "--threads", "1", "--injection", "Lx_Hx"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "exact_accuracy" in printed and (out / "final" / "config.json").exists()
    assert AutoModel.from_pretrained(out / "final").config.injection == "Lx_Hx"
    assert cli.main(["air-report", str(out), "--out", str(tmp_path / "figs"),
                     "--puzzles", "4"]) == 0
    written = capsys.readouterr().out.split()
    assert any(path.endswith("training.png") for path in written)


@pytest.mark.parametrize("argv, message", [
    (["--size", "5"], "size must be one of"),
    (["--injection", "LH"], "injection"),
    (["--heads", "3"], "heads"),
])
def test_air_train_rejects_bad_options_in_one_line(tmp_path, capsys, argv, message):
    import hf_memory_cli as cli

    base = ["air-train", "--out", str(tmp_path / "run"), "--train-puzzles", "4",
            "--test-puzzles", "4", "--steps", "1"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_the_final_model_carries_a_card_with_its_measured_results(sudoku4, tmp_path):
    from huggingface_hub import ModelCard

    train, test = sudoku4
    log = train_air(tiny_solver(), train, test, quick(), out=tmp_path / "air4",
                    card=render_air_card)
    card = ModelCard.load(tmp_path / "air4" / "final" / "README.md")
    results = card.data.eval_results
    assert card.data.library_name == "transformers" and "air" in card.data.tags
    measured = {r.metric_type: r.metric_value for r in results}
    assert measured == pytest.approx({key: round(log["final"]["eval"][key], 4)
                                      for key in ("exact_accuracy", "token_accuracy")})
    assert results[0].dataset_split == "test" and "4x4 Sudoku" in results[0].dataset_name
    assert "`injection` | Lx_H" in card.text


@pytest.fixture
def fresh_compiler():
    """Compiled graphs are process state: drop them before and after the test."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("two_networks", [False, True], ids=["shared", "hrm-style"])
@pytest.mark.slow
def test_compiled_training_computes_the_eager_training(sudoku4, tmp_path, fresh_compiler,
                                                       two_networks):
    train, test = sudoku4
    eager, compiled = (tiny_solver(share_weights=not two_networks) for _ in range(2))
    eager_log = train_air(eager, train, test, quick())
    compiled_log = train_air(compiled, train, test, quick(compile=True), out=tmp_path)
    blocks = {compiled.block_for(level) for level in ("L", "H")}
    assert len(blocks) == (2 if two_networks else 1)
    assert all(block._compiled_call_impl is not None for block in blocks)  # compiled for real
    for eager_entry, compiled_entry in zip(eager_log["history"], compiled_log["history"],
                                           strict=True):
        assert compiled_entry["eval"] == eager_entry["eval"]
        for key in ("loss", "lm_loss", "q_halt_loss", "halted_fraction"):
            assert compiled_entry[key] == pytest.approx(eager_entry[key], rel=1e-6)
    eager_weights = eager.state_dict()
    saved = AutoModel.from_pretrained(tmp_path / "final").state_dict()
    assert saved.keys() == eager_weights.keys()  # no _orig_mod. prefixes
    for name, weight in eager_weights.items():
        torch.testing.assert_close(saved[name], weight, rtol=1e-5, atol=1e-6, msg=name)
