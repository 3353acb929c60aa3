"""Training under ``accelerate launch`` with two processes (gloo, on the CPU) equals one process
on the same global batch: per-step losses, validation, final weights; a run killed after a
checkpoint resumes in two processes to the same weights; a rank's error reaches the test, never a
hang (every launch has a timeout)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launched_training import run, run_air

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "launched_training.py"
LAUNCH_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(*args: str, processes: int = 2) -> subprocess.CompletedProcess:
    """``accelerate launch`` of the training script. On a machine without GPUs ``--multi_gpu`` is
    what starts several processes (torchrun, gloo); ``--cpu`` alone would start one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", str(processes), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
               str(SCRIPT), *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


def launched(*args: str) -> None:
    done = launch(*args)
    assert done.returncode == 0, f"the launch failed:\n{done.stderr[-4000:]}"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_run(log: dict, reference: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert [e["step"] for e in log["history"]] == [e["step"] for e in reference["history"]]
    for name in ("train_loss", "lr"):
        torch.testing.assert_close(torch.tensor([e[name] for e in log["history"]]),
                                   torch.tensor([e[name] for e in reference["history"]]),
                                   rtol=rtol, atol=atol, msg=name)
    torch.testing.assert_close(
        torch.tensor([e["validation"]["nll"] for e in log["history"]]),
        torch.tensor([e["validation"]["nll"] for e in reference["history"]]), rtol=rtol,
        atol=atol)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return out, run(out)


@pytest.mark.slow
def test_two_processes_equal_one_on_the_same_global_batch(one_process, tmp_path):
    single_out, single = one_process
    launched(str(tmp_path))
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["final"]["tokens"] == single["final"]["tokens"] == 6 * 4 * 16
    assert_same_run(log, single)
    # The gradients differ by float summation order (the all-reduce sums two half-batch means);
    # Adam divides by sqrt(v), so where v is tiny (embedding rows seen once) a 1e-7 relative
    # gradient difference moves a weight by up to ~1e-6 per step: 1e-5 is 0.3% of the lr.
    two, one = weights(tmp_path / "final"), weights(single_out / "final")
    assert two.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)
    assert not list(tmp_path.glob(".*.partial")), "a staging folder was left behind"


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_to_the_same_weights(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launched(str(straight))
    done = launch(str(resumed), "--interrupt-at-eval", "5")  # after the checkpoint of step 3
    assert done.returncode != 0
    saved = json.loads((resumed / "checkpoint" / "trainer_log.json").read_text())
    assert saved["step"] == 3 and not (resumed / "final").exists()
    assert sorted(p.name for p in (resumed / "checkpoint" / "state").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]  # each process's RNG state
    launched(str(resumed))
    a, b = weights(straight / "final"), weights(resumed / "final")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-7, msg=name)
    assert_same_run(json.loads((resumed / "log.json").read_text()),
                    json.loads((straight / "log.json").read_text()), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_a_batch_the_processes_cannot_share_names_the_problem(tmp_path):
    done = launch(str(tmp_path), "--batch-size", "3")
    assert done.returncode != 0
    assert "must be a multiple of the 2 processes" in done.stderr


@pytest.mark.slow
def test_air_two_processes_equal_one_on_the_same_global_batch(tmp_path):
    """Each process carries the ACT state of its half of the rows: per-step losses (and their
    parts) and the final weights equal one process's on the whole batch."""
    single = run_air(tmp_path / "one")
    launched(str(tmp_path / "two"), "--air")
    log = json.loads((tmp_path / "two" / "log.json").read_text())
    assert [e["step"] for e in log["history"]] == [1, 2, 3, 4]
    for name in ("loss", "lm_loss", "q_halt_loss", "train_exact_accuracy", "halted_fraction"):
        torch.testing.assert_close(torch.tensor([e[name] for e in log["history"]]),
                                   torch.tensor([e[name] for e in single["history"]]),
                                   rtol=1e-5, atol=1e-6, msg=name)
    two, one = weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final")
    assert two.keys() == one.keys()
    for name in one:  # the tolerance of the ASM test above, for the same reason
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_air_batch_the_processes_cannot_share_names_the_problem(tmp_path):
    done = launch(str(tmp_path), "--air", "--batch-size", "7")
    assert done.returncode != 0
    assert "must be a multiple of the 2 processes" in done.stderr
