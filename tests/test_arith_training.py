"""A tiny training run end to end: loss, progress measures, checkpoints, log, CLI and figures."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import hf_memory_cli as cli
from eval_harness.family.arith_plots import (
    load_log,
    plot_sweep_curves,
    plot_sweeps,
    sweep_points,
    sweep_table,
    training_phases,
    write_report,
)
from modeling.arith import (
    ArithConfig,
    ArithTask,
    ArithTransformer,
    TrainConfig,
    make_pools,
    sample_batch,
    train_arith,
)

TASK = ArithTask(modulus=11, num_variables=4, seq_len=10)
CONFIG = ArithConfig(modulus=11, num_variables=4, max_position_embeddings=10, hidden_size=32,
                     head_dim=16, intermediate_size=64)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith_run")
    train = TrainConfig(steps=300, batch_size=128, lr=3e-3, eval_every=150, eval_pool_size=256,
                        final_pool_size=256, probe_batch_size=256, checkpoint_every=150,
                        threads=1, progress=False)
    threads = torch.get_num_threads()
    try:
        model, log = train_arith(CONFIG, TASK, train, out=out)
    finally:
        torch.set_num_threads(threads)
    return out, model, log


def test_tiny_run_learns(tiny_run):
    _, _, log = tiny_run
    history = log["history"]
    assert [h["step"] for h in history] == [0, 150, 300]
    assert history[-1]["loss"] < 0.5 * math.log(TASK.modulus) < history[1]["loss"]
    chance = 1 / TASK.modulus
    assert history[-1]["accuracy"]["0var/train"] > 0.5 > 3 * chance
    assert set(log["final"]["accuracy"]) == set(history[0]["accuracy"])
    for entry in history:
        assert len(entry["progress"]) == 9
        assert all(math.isfinite(v) for v in entry["progress"].values())
    # the addition circuit is measured, and it improves with the 0-var accuracy
    assert history[-1]["progress"]["ov2_mlp2_accuracy"] > history[0]["progress"][
        "ov2_mlp2_accuracy"]


def test_checkpoints_and_log_on_disk(tiny_run):
    out, model, log = tiny_run
    on_disk = json.loads((out / "log.json").read_text())
    assert on_disk == json.loads(json.dumps(log))
    assert json.loads((out / "task.json").read_text())["modulus"] == 11
    assert (out / "checkpoint-150" / "model.safetensors").is_file()
    loaded = ArithTransformer.from_pretrained(out / "final").eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, CONFIG.vocab_size, (8, TASK.seq_len))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_report_draws_the_figures(tiny_run, tmp_path):
    out, _, _ = tiny_run
    paths = write_report([out], tmp_path)
    names = {p.name for p in paths}
    assert names == {"arith_accuracy.png", "arith_progress.png", "arith_fourier_neuron.png"}
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _swept(base, f, r, accuracy=None, steps=None):
    run = copy.deepcopy(base)
    run["task"].update(held_out_fraction=round(1 - f, 6), two_var_ratio=r)
    if accuracy is not None:
        run["final"]["accuracy"] = dict(accuracy)
    if steps is not None:
        run["final"]["step"] = steps
    return run


def test_sweep_figure_needs_two_settings(tiny_run, tmp_path):
    out, _, _ = tiny_run
    base = load_log(out)
    assert plot_sweeps([base], tmp_path / "one.png") is None
    assert plot_sweep_curves([base], tmp_path / "one_curves.png") is None
    runs = [_swept(base, f, r) for f, r in ((0.7, 1.0), (0.4, 1.0), (0.7, 0.2))]
    for draw in (plot_sweeps, plot_sweep_curves):
        path = draw(runs, tmp_path / f"{draw.__name__}.png")
        assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


def test_report_over_a_sweep_writes_the_figure_its_curves_and_its_table(tiny_run, tmp_path):
    out, _, _ = tiny_run
    base = load_log(out)
    files = []
    for f, r in ((0.7, 1.0), (0.4, 1.0), (0.7, 0.2)):
        run = _swept(base, f, r)
        run.pop("_path")
        files.append(tmp_path / f"f{f}-r{r}.json")
        files[-1].write_text(json.dumps(run))
    paths = write_report(files, tmp_path / "report")
    assert {p.name for p in paths} == {"arith_accuracy.png", "arith_progress.png",
                                       "arith_sweeps.png", "arith_sweep_curves.png",
                                       "arith_sweeps.md"}
    table = (tmp_path / "report" / "arith_sweeps.md").read_text()
    assert table.count("\n| 0.4 | 1 |") == 1 and table.count("\n| 0.2 | 1 |") == 1


def test_sweep_points_split_the_panels_average_seeds_and_weigh_pairs(tiny_run):
    base = load_log(tiny_run[0])

    def accuracy(zero_seen, zero_held, two):
        return {"0var/train": zero_seen, "0var/add_restricted": zero_held,
                "2var/train": two, "2var/add_restricted": two / 2}

    runs = [_swept(base, 0.7, 0.8, accuracy(1.0, 0.9, 0.8)),   # the base run, seed 0
            _swept(base, 0.7, 0.8, accuracy(1.0, 0.7, 0.6)),   # the base run, seed 1
            _swept(base, 0.2, 0.8, accuracy(1.0, 0.1, 0.4)),   # f sweep
            _swept(base, 0.7, 0.1, accuracy(0.9, 0.8, 0.2))]   # r sweep
    points = sweep_points(runs)
    assert (points["base_f"], points["base_r"]) == (0.7, 0.8)
    assert [(p["value"], p["runs"]) for p in points["f"]] == [(0.2, 1), (0.7, 2)]
    assert [(p["value"], p["runs"]) for p in points["r"]] == [(0.1, 1), (0.8, 2)]
    base_point = points["f"][1]
    assert base_point["accuracy"]["0var/add_restricted"] == pytest.approx(0.8)  # seed mean
    assert base_point["score"] == pytest.approx(0.7 * 1.0 + 0.3 * 0.8)  # all 0-var pairs
    assert points["f"][0]["score"] == pytest.approx(0.2 * 1.0 + 0.8 * 0.1)
    assert points["r"][0]["score"] == pytest.approx((0.2 + 0.1) / 2)  # mean of the 2-var pools
    assert points["r"][1]["score"] == pytest.approx((0.7 + 0.35) / 2)
    table = sweep_table(points)
    assert "| 0.2 | 1 | 28.0 | 100.0 | 10.0 |" in table
    assert "| 0.1 | 1 | 15.0 | 20.0 | 10.0 | — | — |" in table


def test_a_sweep_of_runs_of_different_lengths_is_refused(tiny_run):
    base = load_log(tiny_run[0])
    runs = [_swept(base, 0.7, 0.8, steps=100), _swept(base, 0.2, 0.8, steps=200)]
    with pytest.raises(ValueError, match=r"different numbers of steps \[100, 200\]"):
        sweep_points(runs)


def test_training_phases():
    def entry(step, zero, binding, restricted):
        return {"step": step, "accuracy": {"0var/train": zero, "1var/train": binding,
                                           "2var/train": binding,
                                           "1var/var_restricted": restricted}}
    history = [entry(0, 0.1, 0.1, 0.1), entry(10, 0.99, 0.3, 0.1), entry(20, 1.0, 0.9, 0.2),
               entry(30, 1.0, 0.95, 0.9), entry(40, 0.97, 0.99, 0.97)]
    assert training_phases(history) == {"addition": 10, "binding": 20, "refinement": 30}
    flat = [entry(0, 0.5, 0.5, 0.5), entry(10, 0.5, 0.4, 0.5)]
    assert training_phases(flat) == {"addition": None, "binding": None, "refinement": None}


def test_cli_train_and_report(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["arith-train", "--out", str(out), "--steps", "4", "--eval-every", "2",
            "--hidden-size", "16", "--head-dim", "8", "--intermediate-size", "16",
            "--pool-size", "32", "--final-pool-size", "32", "--two-var-ratio", "0.5",
            "--held-out-fraction", "0.4", "--held-out-split", "torch"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "2var/var_restricted(2)" in printed and "novel_positions" in printed
    log = load_log(out)
    assert log["task"]["two_var_ratio"] == 0.5 and log["task"]["held_out_fraction"] == 0.4
    assert log["task"]["one_var_ratio"] == 20 / 12  # the authors' mix unless told otherwise
    assert log["task"]["held_out_split"] == "torch" and log["task"]["split_seed"] == 0
    assert [h["step"] for h in log["history"]] == [0, 2, 4]
    assert cli.main(["arith-report", str(out), "--out", str(tmp_path / "figs")]) == 0
    assert (tmp_path / "figs" / "arith_progress.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["arith-report", "no/such/log.json", "--out", "x"], "cannot draw the report"),
])
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_cli_rejects_bad_fractions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["arith-train", "--out", "x", "--held-out-fraction", "1.5"])
    assert exit_info.value.code == 2
    assert "--held-out-fraction: must be in [0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["arith-train", "--out", "x", "--lr", "0"])
    assert exit_info.value.code == 2
    assert "--lr: must be finite and > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["arith-train", "--out", "x", "--held-out-split", "mine"])
    assert exit_info.value.code == 2
    assert "--held-out-split: invalid choice: 'mine'" in capsys.readouterr().err


def test_pools_that_cannot_exist_are_left_out():
    task = ArithTask(modulus=7, num_variables=3, seq_len=10, held_out_fraction=0.0,
                     no_lhs_variables=())
    pools = make_pools(task, 16, seed=0)
    assert set(pools) == {"0var/train", "1var/train", "2var/train"}
    with pytest.raises(ValueError, match="restricted variables on both operand sides"):
        sample_batch(task, 4, torch.Generator().manual_seed(0), bad_positions=1)


def test_evaluation_never_changes_the_training_models_device_or_dtype(monkeypatch):
    """The periodic evaluation gets a copy of the model, never the training model itself:
    evaluators that move their model to the meta device and cast it to float64 afterwards (what
    ``model.to("cpu")`` did in place to a model training on a GPU) leave every training
    parameter's device, dtype and storage as they were, and the run's weights and log equal those
    of a run with well-behaved evaluators. Needs no GPU."""
    import modeling.arith.training_arith as training

    train = TrainConfig(steps=3, batch_size=16, eval_every=1, eval_pool_size=16,
                        final_pool_size=16, probe_batch_size=32, threads=1, progress=False)
    threads = torch.get_num_threads()
    try:
        clean_model, clean_log = train_arith(CONFIG, TASK, train)
        evaluated: list[torch.nn.Module] = []
        real_progress = training.progress_measures

        def hostile_progress(model, *args):
            result = real_progress(model, *args)
            evaluated.append(model)
            model.to(torch.float64)
            model.to("meta")
            return result

        monkeypatch.setattr(training, "progress_measures", hostile_progress)
        model, log = train_arith(CONFIG, TASK, train)
    finally:
        torch.set_num_threads(threads)
    assert len(evaluated) == 4 and all(m is not model for m in evaluated)
    assert all(p.device.type == "meta" for m in evaluated for p in m.parameters())
    clean = dict(clean_model.named_parameters())
    for name, p in model.named_parameters():
        assert (p.device, p.dtype) == (clean[name].device, clean[name].dtype), name
        assert (p.device.type, p.dtype) == ("cpu", torch.float32), name
        assert torch.equal(p, clean[name]), name
    strip = lambda h: {k: v for k, v in h.items() if k != "elapsed_s"}  # noqa: E731
    assert [strip(h) for h in log["history"]] == [strip(h) for h in clean_log["history"]]
    assert log["final"]["accuracy"] == clean_log["final"]["accuracy"]
