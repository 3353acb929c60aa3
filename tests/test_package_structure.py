"""The package's arrows: nothing imports upward, and ``hf-memory --help`` imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import (the command line sits on top of everything)
ALLOWED = {
    "modeling": set(),
    "hf_memory": set(),
    "hub_cards": {"hf_memory", "modeling"},
    "eval_harness": {"hf_memory", "modeling", "hub_cards"},
    "hf_memory_vllm": {"hf_memory"},  # the vLLM plugin serves banks, never our own families
}
# (benchmarks and experiments are not shipped: no package may import them)
PROJECT = {"modeling", "hf_memory", "hub_cards", "eval_harness", "hf_memory_cli",
           "hf_memory_vllm", "benchmarks", "experiments"}


def _project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & PROJECT


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_package_imports_upward(package):
    offending = {
        str(path.relative_to(ROOT)): sorted(imports - ALLOWED[package] - {package})
        for path in sorted((ROOT / package).rglob("*.py"))
        if (imports := _project_imports(path)) - ALLOWED[package] - {package}
    }
    assert offending == {}


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of a graph ``node -> nodes it imports``, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return [*path, node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every name under ``package`` that ``path`` imports at any depth of the file, relative
    imports resolved (``from .x import y`` in ``a/b.py`` → ``a.x``)."""
    here = _module_name(path).split(".")
    base = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            parent = ".".join(base[:len(base) - node.level + 1])
            found |= ({f"{parent}.{node.module}"} if node.module
                      else {f"{parent}.{alias.name}" for alias in node.names})
    return {name for name in found if name.split(".")[0] == package}


def test_hf_memory_is_arranged_by_role_without_a_circle_between_its_folders():
    package = ROOT / "hf_memory"
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"]
    folders = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = {folder: set() for folder in folders}
    for folder in folders:
        for path in (package / folder).rglob("*.py"):
            edges[folder] |= {name.split(".")[1] for name in _imported_modules(path, "hf_memory")
                              if name.count(".") >= 1} - {folder}
    assert edges["recipes"] >= {"banks", "steering", "selection", "baselines"}  # really read
    assert _find_cycle(edges) is None, " -> ".join(_find_cycle(edges))


@pytest.mark.parametrize("folder", ["hf_memory", "modeling"])
def test_no_import_circle_between_modules(folder):
    edges = {}
    for path in (ROOT / folder).rglob("*.py"):
        edges[_module_name(path)] = _imported_modules(path, folder) - {_module_name(path)}
    edges = {module: imports & set(edges) for module, imports in edges.items()}
    assert len(edges) > 20 and sum(map(len, edges.values())) > 40
    assert _find_cycle(edges) is None, " -> ".join(_find_cycle(edges))


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys\nfrom hf_memory_cli import build_parser\nbuild_parser()\n"
            "print(sorted({'torch', 'transformers', 'modeling'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_command_line_modules_form_no_cycle():
    modules = {p.stem: p for p in (ROOT / "hf_memory_cli").glob("*.py")}
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges[name] = {alias.name if node.module is None else node.module.split(".")[0]
                       for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) and node.level == 1
                       for alias in node.names} & set(modules)
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for nxt in sorted(edges[name]):
            assert state.get(nxt) != "open", " -> ".join([*path, name, nxt])
            if nxt not in state:
                visit(nxt, [*path, name])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert edges["main"] >= {"air", "arith", "memory", "publish"}  # the graph is really read


# Every name hf_memory exported before its modules moved into folders (b54bc12).
PUBLIC_BEFORE_THE_MOVE = [
    "AllowedTokensProcessor", "BankController", "BankSet", "BankSetFormatError", "CAAMethod",
    "CAAVectors", "Conversation", "DEFAULT_MODEL_ID", "DEFAULT_TEMPLATES",
    "DefaultModelUnavailableError", "EMBEDDED_MODELS", "EmbeddedModelUnavailableError",
    "FingerprintMismatchError", "KVFootprint", "MemoryBank", "MemoryMethod", "Method",
    "PersonaSteering", "PlainMethod", "PromptMethod", "RowSteering", "SUPPORTED_MODEL_TYPES",
    "Selector", "SteeringHandle", "Switch", "UnsupportedModelError", "__version__", "apply_caa",
    "calibrate_persona", "chat_messages", "distinct_n", "ensure_default_model_cached",
    "generate_chat", "generate_conversations", "generate_with", "generate_with_each",
    "kv_footprint", "lexicon_rate", "load_default_model", "load_embedded_model",
    "model_fingerprint", "persona_banks", "repeated_ngram_fraction", "repetition", "steer",
    "steered_generate"]


# Names added since, each by the issue that needed it.
ADDED_SINCE = ["JudgeTooWeakError", "ReplyJudge", "judge_methods",  # issue 77: the reply judge
               # issue 80: CAA vectors to and from llama.cpp and lm-eval's steered model
               "ControlVectorFormatError", "export_control_vector", "export_lm_eval_steer",
               "load_control_vector"]


def test_every_name_hf_memory_exported_before_the_move_still_imports_from_it():
    import hf_memory

    assert sorted(hf_memory.__all__) == sorted(PUBLIC_BEFORE_THE_MOVE + ADDED_SINCE)
    for name in PUBLIC_BEFORE_THE_MOVE + ADDED_SINCE:
        assert getattr(hf_memory, name) is not None, name
