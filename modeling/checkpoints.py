"""Crash-safe training outputs shared by the families' training loops (not part of any Hub folder).

A checkpoint or log is written beside its target and renamed over it, so a training run killed
mid-save leaves the previous checkpoint (or none), never a half-written folder that
``from_pretrained`` would load with missing weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["save_pretrained_atomically", "write_json"]


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as key-sorted JSON to ``path``, renamed into place when complete."""
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(name, path)
    finally:
        Path(name).unlink(missing_ok=True)


def save_pretrained_atomically(model: Any, directory: Path,
                               add_files: Callable[[Path], None] | None = None, *,
                               accelerator: Any = None) -> Path:
    """``model.save_pretrained`` (and ``add_files(folder)``, e.g. a model card) into a staging
    sibling of ``directory``, then swap it in.

    The old folder, if any, is moved aside first and deleted only once the new one is in place;
    staging folders left by a killed save are removed by the next save to the same place.

    With an ``accelerate.Accelerator`` of several processes, every process calls this: the main
    process writes the weights into one staging folder, every process then runs ``add_files``
    there (``accelerator.save_state`` writes each process's RNG state; write files only one
    process should write under ``accelerator.is_main_process``), and the main process swaps it
    in; the processes wait for each other between these steps.
    """
    directory = Path(directory)
    many = accelerator is not None and accelerator.num_processes > 1
    main = accelerator is None or accelerator.is_main_process
    prefix = f".{directory.name}."
    shared = directory.parent / f"{prefix}staging.partial"  # known to every process

    def barrier() -> None:
        if many:
            accelerator.wait_for_everyone()

    barrier()
    if main:
        directory.parent.mkdir(parents=True, exist_ok=True)
        for stale in directory.parent.glob(f"{prefix}*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        if many:
            shared.mkdir()
        staging = shared if many else Path(tempfile.mkdtemp(prefix=prefix, suffix=".partial",
                                                             dir=directory.parent))
    else:
        staging = shared
    try:
        if main:
            model.save_pretrained(staging)
        barrier()
        if add_files is not None:
            add_files(staging)
        barrier()
        if main and directory.exists():
            retired = Path(tempfile.mkdtemp(prefix=prefix, suffix=".partial",
                                            dir=directory.parent))
            os.replace(directory, retired / directory.name)
            os.replace(staging, directory)
            shutil.rmtree(retired, ignore_errors=True)
        elif main:
            os.replace(staging, directory)
    finally:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
    barrier()
    return directory
