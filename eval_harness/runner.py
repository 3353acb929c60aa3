"""Run a task and write its results JSON: outputs plus everything needed to reproduce them."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "SCHEMA_PATH", "environment", "payload_schema", "run_task",
           "validate_results"]

SCHEMA_PATH = Path(__file__).parent / "results.schema.json"
PACKAGES = ("hf-memory", "torch", "transformers", "datasets", "evaluate", "safetensors",
            "huggingface-hub", "numpy")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_sha() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Package versions, git commit, Python and platform of this run."""
    return {"packages": {p: _version(p) for p in PACKAGES}, "git_sha": _git_sha(),
            "python": sys.version.split()[0], "platform": platform.platform()}


def payload_schema(task: str) -> Path | None:
    """The payload schema ``<task>.schema.json`` in the task's folder, or None if it has none."""
    return next(Path(__file__).parent.glob(f"*/{task}.schema.json"), None)


def validate_results(results: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` if ``results`` does not follow the schema: the
    task-independent core, a task of the registry, then the task's payload schema
    (``<folder>/<task>.schema.json``) if it has one."""
    import jsonschema

    from .registry import tasks

    jsonschema.validate(results, json.loads(SCHEMA_PATH.read_text()))
    if results["task"] not in tasks():
        raise jsonschema.ValidationError(f"{results['task']!r} is not one of {list(tasks())}")
    payload = payload_schema(results["task"])
    if payload is not None:
        jsonschema.validate(results["results"], json.loads(payload.read_text()))


def run_task(task: str, body: Callable[[], dict[str, Any]], *, model, config: dict[str, Any],
             seed: int, out: str | Path, fingerprint: dict[str, Any] | None = None) -> Path:
    """Time ``body()``, wrap its results with provenance, validate, write ``out/results.json``.

    ``fingerprint`` identifies the model (default: memory inception's fingerprint of a stock
    model); the device it ran on is recorded beside the environment."""
    from hf_memory import model_fingerprint

    start = time.perf_counter()
    results = body()
    record = {
        "schema_version": 1, "task": task,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_time_s": round(time.perf_counter() - start, 2), "seed": seed,
        "environment": {**environment(), "device": str(next(model.parameters()).device)},
        "model": fingerprint or model_fingerprint(model), "config": config,
        "results": results,
    }
    validate_results(record)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path
