"""Artifacts survive an interrupted write: the old one stays loadable or the new one is complete.

Two kinds of kill, each in a forked child of this process (so no trial pays for importing torch
again) that is SIGKILLed: at random instants of saves made back to back (the bank set and the
checkpoint are big enough for a save to take a while), and just before each step of one save
that changes the file system (a rename, an exchange, a removal, a new folder), found by an
audit hook. After every kill the folder must load as the old artifact or the new one.
"""

from __future__ import annotations

import itertools
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_memory import BankSet, MemoryBank
from hf_memory.artifacts import atomic_files


def _bank_set(seed: int, size: int = 4096) -> BankSet:
    """~33 MB of keys and values ([4, 4, 4096, 64] float32 each) by default, so a save takes
    long enough for a kill to land inside it."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(4, 4, size, 64, generator=g) for _ in range(2))
    return BankSet([MemoryBank.from_tensors(keys, values, name="big", layers=(0, 1, 2, 3))])


def _partial_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".partial"))


def _private_progress_lock() -> None:
    """tqdm's write lock holds a semaphore shared across ``fork``: a child killed while holding
    it (a progress bar of ``save_pretrained``) blocked this process's next progress bar forever
    (a loading bar in the CI rehearsal, 2026-12-06). The child gives every tqdm class a lock
    of its own."""
    from tqdm import tqdm

    classes = [tqdm]
    while classes:  # every tqdm class: a subclass that made a bar here holds its own lock
        cls = classes.pop()
        cls._lock = threading.RLock()
        classes.extend(cls.__subclasses__())


def _fork(work: Callable[[int], None]) -> tuple[int, int]:
    """Run ``work(fd)`` in a forked child (``fd``: the write end of a pipe); return the child's
    pid and the read end. The child never returns into pytest: it exits 0 when ``work`` does,
    1 if it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read)
            _private_progress_lock()
            work(write)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _kill_mid_save(saves: list[Callable[[], object]], folder: Path, delay: float,
                   writing: Callable[[Path], object] = _partial_files) -> None:
    """Make the saves in ``saves`` in turn, over and over, in a child until it has finished one
    and started the next (``writing(folder)`` is true: by default a partial file is there), wait
    ``delay`` seconds, then SIGKILL it."""
    def work(fd: int) -> None:
        for i in itertools.count():
            saves[i % len(saves)]()
            os.write(fd, b".")

    pid, read = _fork(work)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        assert ready and os.read(read, 1) == b".", "the writer never finished a save"
        deadline = time.monotonic() + 60
        while not writing(folder):  # the next save is writing now
            assert time.monotonic() < deadline, "the writer never started another save"
            time.sleep(0.0005)
        time.sleep(delay)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)


# What changes what a reader of a folder sees (os.replace raises "os.rename").
_STEPS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree",
          "ctypes.call_function"}


def _killed_before_step(save: Callable[[], object], step: int) -> bool:
    """Run ``save`` in a child that SIGKILLs itself just before its ``step``-th (from 1) file
    system change; True if it was killed, False if the save finished first."""
    def work(fd: int) -> None:
        seen = 0

        def hook(event: str, args: tuple) -> None:
            nonlocal seen
            if event in _STEPS:
                seen += 1
                if seen == step:
                    os.kill(os.getpid(), signal.SIGKILL)

        sys.addaudithook(hook)
        save()

    pid, read = _fork(work)
    os.close(read)
    deadline = time.monotonic() + 60
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the save never finished")
        time.sleep(0.001)
    if os.WIFSIGNALED(status[1]):
        assert os.WTERMSIG(status[1]) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status[1]) == 0, "the save raised"
    return False


def _bank_hash(folder: Path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning of a config.json left by a killed save
        return BankSet.from_pretrained(folder).banks[0].content_hash()


@pytest.mark.slow
def test_a_save_killed_at_a_random_instant_leaves_the_old_bank_set_or_the_new_one(tmp_path):
    sets = [_bank_set(1), _bank_set(2)]
    expected = {bank_set.banks[0].content_hash() for bank_set in sets}
    rng = random.Random(0)
    for trial in range(24):
        _kill_mid_save([lambda s=s: s.save_pretrained(tmp_path) for s in sets], tmp_path,
                       rng.uniform(0.0, 0.15))
        assert _bank_hash(tmp_path) in expected, trial
    _bank_set(3).save_pretrained(tmp_path)  # the next save clears what a killed one left
    assert _partial_files(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md", "banks.safetensors", "config.json"]
    assert _bank_hash(tmp_path) == _bank_set(3).banks[0].content_hash()


def test_a_bank_set_save_killed_before_any_of_its_steps_leaves_the_old_or_the_new(tmp_path):
    old, new, third = (_bank_set(seed, size=8) for seed in (1, 2, 3))
    outcomes = []
    for step in itertools.count(1):
        folder = tmp_path / str(step)
        old.save_pretrained(folder)
        killed = _killed_before_step(lambda f=folder: new.save_pretrained(f), step)
        loaded = _bank_hash(folder)
        assert loaded in {old.banks[0].content_hash(), new.banks[0].content_hash()}, step
        outcomes.append("new" if loaded == new.banks[0].content_hash() else "old")
        third.save_pretrained(folder)
        assert _partial_files(folder) == [] and _bank_hash(folder) == third.banks[0].content_hash()
        if not killed:
            break
    # the weights' rename is the save: before it the old set, after it the new one
    assert outcomes[0] == "old" and outcomes[-1] == "new" and len(outcomes) >= 4, outcomes
    assert outcomes == sorted(outcomes, key=["old", "new"].index), outcomes


def _safetensors_temporary(folder: Path) -> list[Path]:
    """The temporary file the safetensors library writes and then renames (``.tmpXXXXXX``),
    in ``folder`` or in a partial folder in it."""
    return [*folder.glob(".tmp*"), *folder.glob(f"*{atomic_files._SUFFIX}/.tmp*")]


def test_a_save_killed_while_safetensors_writes_leaves_no_stray_file(tmp_path):
    sets = [_bank_set(1), _bank_set(2)]
    for _ in range(2):
        _kill_mid_save([lambda s=s: s.save_pretrained(tmp_path) for s in sets], tmp_path, 0.0,
                       writing=_safetensors_temporary)
        assert _bank_hash(tmp_path) in {s.banks[0].content_hash() for s in sets}
    sets[0].save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md", "banks.safetensors", "config.json"]


def test_new_weights_beside_an_older_config_load_as_the_new_bank_set(tmp_path):
    old, new = _bank_set(1, size=8), _bank_set(2, size=8)
    old.save_pretrained(tmp_path / "old")
    new.save_pretrained(tmp_path / "new")
    os.replace(tmp_path / "new" / "banks.safetensors", tmp_path / "old" / "banks.safetensors")
    with pytest.warns(UserWarning, match="does not describe the banks beside it"):
        loaded = BankSet.from_pretrained(tmp_path / "old")
    assert loaded.banks[0].content_hash() == new.banks[0].content_hash()


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


def _arith_model(seed: int, width: int = 512):
    """An ArithTransformer of ~25 MB by default, so a save takes long enough for a kill to land
    in it."""
    from modeling.arith import ArithConfig, ArithTransformer

    torch.manual_seed(seed)
    return ArithTransformer(ArithConfig(hidden_size=width, head_dim=width,
                                        intermediate_size=4 * width))


def _which_checkpoint(folder: Path, states: list[dict]) -> int:
    """The index in ``states`` of the weights ``folder`` loads (a checkpoint must be there)."""
    from modeling.arith import ArithTransformer

    assert folder.is_dir(), f"{folder} is gone"
    state = ArithTransformer.from_pretrained(folder).state_dict()
    found = [i for i, ref in enumerate(states)
             if state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)]
    assert found, f"{folder} holds neither checkpoint"
    return found[0]


@pytest.mark.slow
def test_a_checkpoint_save_killed_at_a_random_instant_leaves_the_old_or_the_new(tmp_path):
    from modeling.checkpoints import save_pretrained_atomically

    models = [_arith_model(seed) for seed in (1, 2)]
    states = [model.state_dict() for model in models]
    rng = random.Random(0)
    for trial in range(30):
        _kill_mid_save([lambda m=m: save_pretrained_atomically(m, tmp_path / "checkpoint")
                        for m in models], tmp_path, rng.uniform(0.0, 0.03))
        assert _which_checkpoint(tmp_path / "checkpoint", states) in (0, 1), trial
    third = _arith_model(3)
    save_pretrained_atomically(third, tmp_path / "checkpoint")
    assert _partial_files(tmp_path) == []  # the next save clears what a killed one left
    assert _which_checkpoint(tmp_path / "checkpoint", [third.state_dict()]) == 0


def test_a_checkpoint_save_killed_before_any_of_its_steps_leaves_the_old_or_the_new(tmp_path):
    from modeling.checkpoints import save_pretrained_atomically

    old, new, third = (_arith_model(seed, width=8) for seed in (1, 2, 3))
    states = [old.state_dict(), new.state_dict()]
    outcomes = []
    for step in itertools.count(1):
        folder = tmp_path / str(step)
        save_pretrained_atomically(old, folder / "checkpoint")
        killed = _killed_before_step(
            lambda f=folder: save_pretrained_atomically(new, f / "checkpoint"), step)
        outcomes.append(["old", "new"][_which_checkpoint(folder / "checkpoint", states)])
        save_pretrained_atomically(third, folder / "checkpoint")
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoint"]
        assert _which_checkpoint(folder / "checkpoint", [third.state_dict()]) == 0
        if not killed:
            break
    assert outcomes[0] == "old" and outcomes[-1] == "new" and len(outcomes) >= 4, outcomes
    assert outcomes == sorted(outcomes, key=["old", "new"].index), outcomes


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
