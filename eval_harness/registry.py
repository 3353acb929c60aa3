"""The ``hf-memory eval`` tasks, each declared in its own folder.

A folder ``eval_harness/<folder>/`` takes part by holding a ``cli.py`` whose ``TASKS`` lists its
:class:`EvalTask`\\ s. :func:`tasks` finds them by scanning the package's subfolders with
:mod:`pkgutil`, so adding a task touches its folder only: no list kept elsewhere, and it works
from a plain checkout (an entry-point group would need a reinstall after every new task). The
``cli.py`` modules import no torch, so ``--help`` stays fast; what runs is imported when called
(:func:`lazy`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["EvalTask", "config_run", "lazy", "recorded", "task", "tasks"]


def recorded(config, args: argparse.Namespace) -> dict[str, Any]:
    """The config as ``results.json`` records it: a dataclass's fields, or the dict itself."""
    return config if isinstance(config, dict) else vars(config)


@dataclass(frozen=True)
class EvalTask:
    """One ``hf-memory eval`` task.

    ``add_arguments(parser)`` adds the task's flags (the shared ones through
    :func:`eval_harness.arguments.add_shared`; ``--model``, ``--seed`` and ``--out`` every task
    has). ``build_config(args, out)`` turns the parsed flags into the task's config, refusing
    bad input before any model loads. ``load(args)`` returns ``(model, tokenizer)`` (None: the
    command line's loader of ``--model``). ``run(model, tokenizer, config, seed)`` returns the
    results payload, ``record(config, args)`` the config written beside it, ``fingerprint``
    identifies the model (None: memory inception's fingerprint of a stock model) and
    ``render(record, out)`` writes the report, returning its files.
    """

    name: str
    summary: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build_config: Callable[[argparse.Namespace, Path], Any]
    run: Callable[[Any, Any, Any, int], dict[str, Any]]
    render: Callable[[dict[str, Any], Path], list[Path]]
    load: Callable[[argparse.Namespace], tuple[Any, Any]] | None = None
    record: Callable[[Any, argparse.Namespace], dict[str, Any]] = recorded
    fingerprint: Callable[[Any], dict[str, Any]] | None = None


def lazy(module: str, name: str) -> Callable[..., Any]:
    """A function calling ``module.name``, imported at the first call (keeps torch out of
    ``--help``)."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


@cache
def tasks() -> dict[str, EvalTask]:
    """Every task, by name: the ``TASKS`` of each ``eval_harness/<folder>/cli.py``, folders in
    alphabetical order."""
    import eval_harness

    found: dict[str, EvalTask] = {}
    for folder in sorted(pkgutil.iter_modules(eval_harness.__path__), key=lambda m: m.name):
        if not folder.ispkg or importlib.util.find_spec(f"eval_harness.{folder.name}.cli") is None:
            continue
        for declared in importlib.import_module(f"eval_harness.{folder.name}.cli").TASKS:
            if declared.name in found:
                raise ValueError(f"two eval tasks are named {declared.name!r}")
            found[declared.name] = declared
    return found


def task(name: str) -> EvalTask:
    """The task ``name``, or a ``ValueError`` naming the known ones."""
    if name not in tasks():
        raise ValueError(f"unknown task {name!r}; the tasks: {', '.join(tasks())}")
    return tasks()[name]


def config_run(module: str, name: str) -> Callable[[Any, Any, Any, int], dict[str, Any]]:
    """``run`` of a task whose config holds its seed: ``module.name(model, tokenizer, config)``,
    imported at the first call."""
    function = lazy(module, name)
    return lambda model, tokenizer, config, seed: function(model, tokenizer, config)
