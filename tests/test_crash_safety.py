"""Artifacts survive an interrupted write: the old one stays loadable or the new one is complete."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_memory import BankSet, BankSetFormatError, MemoryBank
from hf_memory.artifacts import atomic_files

REPO = Path(__file__).resolve().parents[1]
WRITER = """
import sys
from tests.test_crash_safety import _bank_set

sets = [_bank_set(1), _bank_set(2)]
for i in range(10_000):
    sets[i % 2].save_pretrained(sys.argv[1])
    print(i, flush=True)
"""


def _bank_set(seed: int) -> BankSet:
    """~33 MB of keys and values ([4, 4, 4096, 64] float32 each), so a save takes long enough
    for a kill to land inside it."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(4, 4, 4096, 64, generator=g) for _ in range(2))
    return BankSet([MemoryBank.from_tensors(keys, values, name="big", layers=(0, 1, 2, 3))])


def _partial_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".partial"))


def _kill_mid_save(script: str, folder: Path, delay: float) -> None:
    """Run ``script`` (saving into ``folder`` over and over, printing after each save) until it
    has finished one save and started the next, wait ``delay`` seconds, then SIGKILL it."""
    writer = subprocess.Popen([sys.executable, "-c", script, str(folder)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip().isdigit()  # one complete save on disk
        deadline = time.monotonic() + 60
        while not _partial_files(folder):  # the next save is writing now
            assert time.monotonic() < deadline, "the writer never started another save"
            time.sleep(0.0005)
        time.sleep(delay)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()


@pytest.mark.slow
def test_a_killed_save_leaves_the_old_bank_set_or_the_new_one(tmp_path):
    expected = {_bank_set(seed).banks[0].content_hash() for seed in (1, 2)}
    rng = random.Random(0)
    outcomes = []
    for _ in range(4):
        _kill_mid_save(WRITER, tmp_path, rng.uniform(0.0, 0.02))
        try:
            loaded = BankSet.from_pretrained(tmp_path)
        except BankSetFormatError as error:  # only in the instant between the two renames
            assert "content hash" in str(error)
            outcomes.append("refused")
        else:
            assert loaded.banks[0].content_hash() in expected
            outcomes.append("loaded")
    assert outcomes.count("loaded") >= 3, outcomes
    _bank_set(3).save_pretrained(tmp_path)  # the next save clears what a killed one left
    assert _partial_files(tmp_path) == []
    assert BankSet.from_pretrained(tmp_path).banks[0].content_hash() == (
        _bank_set(3).banks[0].content_hash())


def test_a_save_that_fails_midway_changes_nothing(tmp_path, monkeypatch):
    old = _bank_set(1)
    old.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def half_then_fail(tensors, path, metadata=None):
        Path(path).write_bytes(b"\x00" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic_files, "save_file", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        _bank_set(2).save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert BankSet.from_pretrained(tmp_path).banks[0].content_hash() == (
        old.banks[0].content_hash())


def test_atomic_text_and_json_writes_replace_whole_files(tmp_path):
    path = tmp_path / "deep" / "record.json"
    atomic_files.write_json(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    atomic_files.write_text(path, "short")
    assert path.read_text() == "short" and _partial_files(path.parent) == []


def test_a_save_leaves_a_live_writers_partial_file_and_removes_a_dead_ones(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        live = tmp_path / f".record.json.{sleeper.pid}.abc{atomic_files._SUFFIX}"
        gone = tmp_path / f".record.json.{dead.pid}.abc{atomic_files._SUFFIX}"
        live.write_text("half")
        gone.write_text("half")
        atomic_files.write_json(tmp_path / "record.json", {"a": 1})
        assert live.exists() and not gone.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


CHECKPOINT_WRITER = """
import sys
from pathlib import Path
from modeling.checkpoints import save_pretrained_atomically
from tests.test_crash_safety import _arith_model

models = [_arith_model(1), _arith_model(2)]
for i in range(10_000):
    save_pretrained_atomically(models[i % 2], Path(sys.argv[1]) / "checkpoint")
    print(i, flush=True)
"""


def _arith_model(seed: int):
    """An ArithTransformer of ~25 MB, so a save takes long enough for a kill to land in it."""
    from modeling.arith import ArithConfig, ArithTransformer

    torch.manual_seed(seed)
    return ArithTransformer(ArithConfig(hidden_size=512, head_dim=512, intermediate_size=2048))


@pytest.mark.slow
def test_a_killed_checkpoint_save_leaves_the_old_checkpoint_or_the_new_one(tmp_path):
    from modeling.arith import ArithTransformer
    from modeling.checkpoints import save_pretrained_atomically

    expected = [_arith_model(seed).state_dict() for seed in (1, 2)]
    rng = random.Random(0)
    outcomes = []
    for _ in range(4):
        _kill_mid_save(CHECKPOINT_WRITER, tmp_path, rng.uniform(0.0, 0.05))
        if not (tmp_path / "checkpoint").exists():  # only between the two renames of a swap
            outcomes.append("moved aside")
            continue
        state = ArithTransformer.from_pretrained(tmp_path / "checkpoint").state_dict()
        assert any(all(torch.equal(state[k], ref[k]) for k in ref) for ref in expected)
        outcomes.append("loaded")
    assert outcomes.count("loaded") >= 3, outcomes
    save_pretrained_atomically(_arith_model(3), tmp_path / "checkpoint")
    assert _partial_files(tmp_path) == []  # the next save clears what a killed one left
    state = ArithTransformer.from_pretrained(tmp_path / "checkpoint").state_dict()
    assert all(torch.equal(v, _arith_model(3).state_dict()[k]) for k, v in state.items())


def test_a_checkpoint_save_that_fails_midway_keeps_the_old_one(tmp_path):
    from modeling.arith import ArithConfig, ArithTransformer
    from modeling.checkpoints import save_pretrained_atomically

    tiny = ArithConfig(hidden_size=16, head_dim=8, intermediate_size=16)
    old = ArithTransformer(tiny)
    save_pretrained_atomically(old, tmp_path / "checkpoint")

    def fail(folder: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_pretrained_atomically(ArithTransformer(tiny), tmp_path / "checkpoint",
                                   add_files=fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    state = ArithTransformer.from_pretrained(tmp_path / "checkpoint").state_dict()
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in state.items())
