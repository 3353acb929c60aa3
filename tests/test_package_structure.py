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
    "hf_memory": {"hub_cards"},  # bank and selector cards
    "hub_cards": {"hf_memory", "modeling"},
    "eval_harness": {"hf_memory", "modeling", "hub_cards"},
    "hf_memory_vllm": {"hf_memory"},  # the vLLM plugin serves banks, never our own families
}
PROJECT = {"modeling", "hf_memory", "hub_cards", "eval_harness", "hf_memory_cli",
           "hf_memory_vllm"}


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
