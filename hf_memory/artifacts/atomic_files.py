"""Crash-safe artifact files: each file is written beside its target and renamed over it.

A reader therefore sees every file either as it was or complete, never half written, even if
the writing process is killed. Artifacts that span several files write their payload first and
the file that describes it last, and record what they need to notice a mix of old and new (the
bank set keeps a content hash per bank).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

__all__ = ["write_json", "write_safetensors", "write_text"]

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
    """Run ``fill(tmp)`` on a fresh temporary file beside ``path``, sync it, rename it over.

    Temporary files carry their writer's pid; the ones whose writer is gone (killed mid-save)
    are removed, a concurrent writer's are left alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*{_SUFFIX}"):
        pid = stale.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=_SUFFIX,
                                    dir=path.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        fill(tmp)
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
