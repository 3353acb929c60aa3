"""Hub-ready folders, and pushing them: the one path every artifact of the package takes.

``export_folder`` writes a folder a Hub repo can hold as it is: for our model families the
safetensors weights, ``config.json`` with ``auto_map``, the family's flat code files (copied by
``save_pretrained`` because the classes are registered for the Auto classes),
``generation_config.json`` for generative models, and a README card (kept if the model's own
training wrote one beside it, else a generic card); for bank sets and selectors their own
``save_pretrained`` folder with its card. ``push_folder`` uploads such a folder to the Hub
(``huggingface_hub.upload_folder``), or commits it to a local git repository laid out
``<root>/models/<org>/<name>`` on branch ``main``, which a self-hosted Hub server serves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["ExportError", "export_folder", "load_artifact", "push_folder"]

MODEL_TYPES = ("asm", "air", "arith")


class ExportError(ValueError):
    """The folder or object is not something this package exports."""


def _generic_card(model: Any) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    config = model.config
    data = ModelCardData(license="apache-2.0", library_name="transformers",
                         tags=["hf-memory", config.model_type, "custom_code"])
    body = (f"# {type(model).__name__}\n\n"
            f"A `{type(model).__name__}` of the hf-memory package (`model_type` "
            f"`{config.model_type}`, {sum(p.numel() for p in model.parameters()):,} parameters)."
            "\n\n## Use\n\n```python\nfrom transformers import AutoModel\n\nmodel = "
            'AutoModel.from_pretrained("<this repo>", trust_remote_code=True)\n```\n\n'
            "## Limitations\n\nNo evaluation results were attached when this folder was "
            "exported; the training run's own card, where there is one, states them.\n")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def export_folder(obj: Any, out_dir: str | os.PathLike, *, card: str | None = None) -> Path:
    """Write ``obj`` (an ASM / AIR / Arith model, a ``BankSet`` or a ``Selector``) as a Hub-ready
    folder at ``out_dir``; ``card`` replaces the README the folder would otherwise get."""
    from transformers import PreTrainedModel

    out = Path(out_dir)
    if isinstance(obj, PreTrainedModel):
        if obj.config.model_type not in MODEL_TYPES:
            raise ExportError(f"export takes the package's own models ({', '.join(MODEL_TYPES)}); "
                              f"got model_type {obj.config.model_type!r}")
        obj.save_pretrained(out)
        if card is not None or not (out / "README.md").is_file():
            (out / "README.md").write_text(card if card is not None else _generic_card(obj))
        return out
    if not hasattr(obj, "save_pretrained"):
        raise ExportError(f"cannot export a {type(obj).__name__}")
    obj.save_pretrained(out)
    if card is not None:
        (out / "README.md").write_text(card)
    return out


def load_artifact(folder: str | os.PathLike) -> Any:
    """Load what a saved folder holds: a model of ours, a bank set or a selector."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder (give a save_pretrained folder)")
    if (folder / "selector.json").is_file():
        from hf_memory import Selector

        return Selector.from_pretrained(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ExportError(f"{folder} holds no config.json or selector.json") from None
    except ValueError as error:
        raise ExportError(f"{folder}/config.json is not valid JSON: {error}") from None
    if config.get("kind") == "memory_inception_bank_set":
        from hf_memory import BankSet

        return BankSet.from_pretrained(folder)
    if config.get("model_type") not in MODEL_TYPES:
        raise ExportError(f"{folder} holds model_type {config.get('model_type')!r}; export takes "
                          f"{', '.join(MODEL_TYPES)}, bank sets and selectors")
    if not any((folder / name).is_file() for name in ("model.safetensors",
                                                      "model.safetensors.index.json")):
        raise ExportError(f"{folder} holds no model.safetensors weights")
    from safetensors import SafetensorError
    from transformers import AutoModel, AutoModelForCausalLM

    import modeling  # noqa: F401  (registers the families with the Auto classes)

    auto = AutoModelForCausalLM if config["model_type"] == "asm" else AutoModel
    try:
        return auto.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:  # a tampered file
        raise ExportError(f"cannot load {folder}: {str(error).splitlines()[0]}") from None


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-c", "user.name=hf-memory", "-c",
                             "user.email=hf-memory@localhost", *args], cwd=repo,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"git {args[0]} failed in {repo}: {result.stderr.strip()}")
    return result.stdout.strip()


def push_folder(folder: str | os.PathLike, repo_id: str, *, git_root: str | os.PathLike | None
                = None, tag: str | None = None, message: str = "Upload with hf-memory",
                token: str | None = None, private: bool | None = None) -> str:
    """Push an exported folder to ``repo_id``; returns the new commit's id.

    Without ``git_root``, through the Hub's HTTP API (``create_repo`` + ``upload_folder``, then
    ``create_tag``). With it, as a commit on branch ``main`` of the git repository
    ``<git_root>/models/<repo_id>`` (created if missing; files absent from ``folder`` are
    removed), tagged ``tag`` — the layout a self-hosted Hub mirror serves.
    """
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise ExportError(f"{folder} is not a folder with files to push")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ExportError(f"repo id must look like org/name, got {repo_id!r}")
    if git_root is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=message)
        if tag is not None:
            api.create_tag(repo_id, tag=tag, revision=info.oid)
        return info.oid
    repo = Path(git_root) / "models" / repo_id
    if not (repo / ".git").is_dir():
        repo.mkdir(parents=True, exist_ok=True)
        _git(repo, "init", "-q", "-b", "main")
    for path in repo.iterdir():
        if path.name != ".git":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.copytree(folder, repo, dirs_exist_ok=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", message)
    if tag is not None:
        _git(repo, "tag", "-f", tag)
    return _git(repo, "rev-parse", "HEAD")
