"""The ``lm-eval`` task: lm-evaluation-harness tasks on a (steered) model, kept in our results
schema (``lm-eval.schema.json``) so ``hf-memory report`` and ``hf-memory card`` read them.

:func:`run_lm_eval` runs ``lm_eval.simple_evaluate`` on an :class:`~.model.HFMemoryLM` with the
shipped offline tasks (``tasks/``, lm-eval YAML) and any ``include_path`` of the user's on the
task path; the Hub's standard tasks (MMLU, HellaSwag, …) by name where the Hub is reachable.
The payload keeps lm-eval's per-task results and versions, the flat ``metrics``
(``task/metric``: value) that cards list, and the steering with its artifacts' hashes.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TASKS_DIR", "check_tasks", "run_lm_eval"]

TASKS_DIR = Path(__file__).parent / "tasks"


@functools.lru_cache(maxsize=8)
def _indexed(paths: tuple[str, ...], files: tuple):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths))


def _files(include_path: Sequence[str]) -> tuple:
    """What the user's task folders hold (name, size, mtime), so an edit rebuilds the index."""
    found = []
    for root in map(Path, include_path):
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file():
                stat = path.stat()
                found.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(found)


def _task_manager(include_path: Sequence[str] = ()):
    """lm-eval's task index over lm-eval's own tasks, ours and ``include_path``. Building it
    reads ~15,000 task files (5 s), so it is kept per process and rebuilt when a file under
    ``include_path`` changes; the index is only read (tasks are made afresh per run)."""
    paths = (str(TASKS_DIR), *map(str, include_path))
    return _indexed(paths, _files(include_path))


def check_tasks(tasks: Sequence[str], include_path: Sequence[str] = ()):
    """The task manager, or a ``ValueError`` naming the tasks lm-eval does not know."""
    if isinstance(tasks, str) or not tasks:
        raise ValueError("give at least one lm-eval task (e.g. hfm_capability_mc)")
    manager = _task_manager(include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"lm-eval knows no task {', '.join(map(repr, unknown))} (the offline "
                         f"ones: {', '.join(sorted(p.stem for p in TASKS_DIR.glob('*.yaml')))})")
    return manager


def run_lm_eval(lm, tasks: Sequence[str], *, include_path: Sequence[str] = (),
                limit: int | None = None, num_fewshot: int | None = None,
                apply_chat_template: bool = False, seed: int = 0) -> dict[str, Any]:
    """Run ``tasks`` on ``lm`` (an :class:`~.model.HFMemoryLM`) and return the payload."""
    import lm_eval

    from .model import steering_record

    manager = check_tasks(tasks, include_path)
    output = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
        num_fewshot=num_fewshot, apply_chat_template=apply_chat_template, log_samples=False,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed, bootstrap_iters=1000)
    results = {task: {key: value for key, value in row.items() if key != "alias"
                      and isinstance(value, (int, float))}
               for task, row in output["results"].items()}
    metrics = {f"{task}/{key.replace(',none', '').replace(',', ':')}": value
               for task, row in results.items() for key, value in row.items()
               if "_stderr" not in key}
    return {"lm_eval_version": importlib.metadata.version("lm_eval"),
            "tasks": list(tasks), "results": results,
            "versions": {k: v for k, v in output.get("versions", {}).items()},
            "n_shot": dict(output.get("n-shot", {})),
            "samples": {task: row.get("effective", row.get("original"))
                        for task, row in output.get("n-samples", {}).items()},
            "metrics": metrics, "steering": steering_record(lm)}
