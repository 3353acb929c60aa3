"""Crash-safe training outputs shared by the families' training loops (not part of any Hub folder).

A checkpoint or log is written beside its target and renamed over it, so a training run killed
mid-save leaves the previous checkpoint (or none), never a half-written folder that
``from_pretrained`` would load with missing weights.

A checkpoint is a folder of several files read by ``from_pretrained`` (and ``load_state``) as
they stand, so its files keep their names and it is replaced whole: the new folder is written
into a staging sibling and the two folders are exchanged in one step, ``renameat2(...,
RENAME_EXCHANGE)`` on Linux (ext4, xfs, btrfs, tmpfs, overlayfs). A kill at any instant leaves
the old folder or the new one at its name, never neither; the old one, now at the staging name,
is deleted after the exchange, or by the next save to the same place if the kill came first, so
repeated (and repeatedly killed) saves leave at most one staging folder behind. POSIX
``rename`` cannot replace a non-empty folder, and a folder kept behind a symlink breaks
``cp -r`` and moving it alone, hence the exchange. Where it is unavailable (another OS, or a
filesystem that refuses it, e.g. NFS) the old folder is renamed aside and the new one renamed
in, and a kill between those two renames leaves the checkpoint only at the staging name.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
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


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` (both existing, in the same folder) in one step.

    False, with nothing changed, where this OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _swap_in(staging: Path, directory: Path) -> None:
    """Put the folder ``staging`` at ``directory``; whatever was there is deleted."""
    if not directory.exists():
        os.replace(staging, directory)
    elif _exchange(staging, directory):
        shutil.rmtree(staging, ignore_errors=True)  # the old folder, now at the staging name
    else:
        retired = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial",
                                        dir=directory.parent))
        os.replace(directory, retired / directory.name)
        os.replace(staging, directory)
        shutil.rmtree(retired, ignore_errors=True)


def save_pretrained_atomically(model: Any, directory: Path,
                               add_files: Callable[[Path], None] | None = None, *,
                               accelerator: Any = None) -> Path:
    """``model.save_pretrained`` (and ``add_files(folder)``, e.g. a model card) into a staging
    sibling of ``directory``, then swap it in.

    The new folder takes the old one's place in one step (see the module docstring) and the old
    one is deleted after; staging folders left by a killed save are removed by the next save to
    the same place.

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
        if main:
            _swap_in(staging, directory)
    finally:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
    barrier()
    return directory
