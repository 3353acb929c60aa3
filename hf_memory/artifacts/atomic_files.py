"""Crash-safe artifact files: each file is written beside its target and renamed over it.

A reader therefore sees every file either as it was or complete, never half written, even if
the writing process is killed. Each file is written inside a temporary folder of its own beside
the target (``.<name>.<pid>.<random>.partial/``), so whatever a writer makes next to the file it
is given (safetensors writes a ``.tmp…`` file and renames it) stays in that folder; the next
write to the same name removes the folders of writers that are gone, so killed saves leave no
garbage that grows.

An artifact of several files must be saved in one atomic step as well, old or new and never
neither after a kill: the bank set's weights file carries the whole config and its rename is
the save (:mod:`hf_memory.banks.bank_set` says how a loader reads a folder left between two
renames); a training checkpoint, read by ``from_pretrained`` as it stands, is written as a
folder beside the old one and exchanged with it in one step (``modeling/checkpoints.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

__all__ = ["write_file", "write_json", "write_safetensors", "write_text"]

_SUFFIX = ".partial"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _write(path: Path, fill: Callable[[Path], None]) -> Path:
    """Run ``fill(tmp)`` on a fresh path in a temporary folder beside ``path``, sync the file,
    rename it over ``path`` and remove the folder.

    Temporary folders (and the files earlier versions wrote instead) carry their writer's pid;
    the ones whose writer is gone (killed mid-save) are removed, a concurrent writer's are left
    alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*{_SUFFIX}"):
        pid = stale.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or not _alive(int(pid)):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=_SUFFIX,
                                   dir=path.parent))
    tmp = folder / path.name
    try:
        fill(tmp)
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return path


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return _write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: Path, record: Any) -> Path:
    """Write ``record`` as indented, key-sorted JSON to ``path`` atomically."""
    return write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` as a safetensors file at ``path`` atomically."""
    return _write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def write_file(path: Path, fill: Callable[[Path], None]) -> Path:
    """Write ``path`` atomically with a writer of any format: ``fill`` gets a temporary path
    beside it to write to (e.g. ``lambda tmp: torch.save(obj, tmp)``)."""
    return _write(Path(path), fill)
