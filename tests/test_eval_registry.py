"""``hf-memory eval``'s task registry: every task builds the config it built before the
registry, each task's parser holds its flags only, and a task added in a folder of its own runs
with nothing else changed."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest

import eval_harness
import eval_harness.lm_eval_model.task as lm_eval_task
import hf_memory_cli as cli
from eval_harness.names import TASKS
from eval_harness.registry import tasks
from tests.eval_config_snapshot import ADDED, ARGV, CONFIGS, DEFAULTS, OUT, SEEDS


def _fields(value):
    """``value`` with its types spelled out, so 1 != 1.0 and a list != a tuple."""
    if isinstance(value, dict):
        return {key: _fields(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_fields(item) for item in value])
    return (type(value).__name__, value)


@pytest.mark.parametrize("key", sorted(CONFIGS), ids="-".join)
def test_every_task_builds_the_config_the_old_builder_built(key):
    task, kind = key
    argv = {"given": ARGV, "defaults": DEFAULTS}[kind][task]
    args = cli.build_parser().parse_args(["eval", task, *argv, "--out", OUT])
    declared = tasks()[task]
    with mock.patch.object(lm_eval_task, "check_tasks", lambda *a: None):
        config = declared.build_config(args, Path(OUT))
    recorded = declared.record(config, args)
    expected_config = {**CONFIGS[key], **ADDED.get(task, {})}
    assert sorted(recorded) == sorted(expected_config)
    for field, expected in expected_config.items():
        assert _fields(recorded[field]) == _fields(expected), field
    assert args.seed == SEEDS.get(key, 0)


def test_the_registry_holds_every_task_of_the_command_line():
    assert set(TASKS) == {task for task, _ in CONFIGS} and len(TASKS) == 18


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_a_task_help_shows_that_task_flags_only(capsys):
    text = _help(["eval", "persona-ab"], capsys)
    assert "--heldout-items" in text and "--max-delta-nll" in text and "--model" in text
    assert "--puzzles" not in text and "--traits" not in text and "--suite" not in text
    assert "(default: 3)" in text  # persona-ab's own layer budget
    assert "--puzzles" in _help(["eval", "air-sudoku"], capsys)
    listing = _help(["eval"], capsys)
    assert all(name in listing for name in TASKS) and "--suite" in listing


def test_a_flag_of_another_task_names_the_tasks_that_take_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", "capability", "--top-layers", "3"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--top-layers is a " in last and "persona-ab" in last and "not capability's" in last
    assert "layer-ablation" in last and "kv-footprint" in last


def test_old_order_of_out_before_the_task_still_sets_the_output():
    args = cli.build_parser().parse_args(["eval", "--out", "elsewhere", "kv-footprint"])
    assert (args.task, args.suite_out, args.out) == ("kv-footprint", "elsewhere", None)


TOY_CLI = '''
"""A toy task: the mean of --numbers, on a one-parameter model."""

from eval_harness.arguments import add_shared
from eval_harness.registry import EvalTask


def _add(parser):
    parser.add_argument("--numbers", default="1,2,3", help="comma-separated numbers")
    add_shared(parser, "--bootstrap")


def _load(args):
    import torch

    return torch.nn.Linear(1, 1), None


def _run(model, tokenizer, config, seed):
    values = [float(v) for v in config["numbers"].split(",")]
    return {"mean": sum(values) / len(values)}


def _render(record, out):
    path = out / "report.md"
    path.write_text(f"# toy\\n\\nmean {record['results']['mean']}\\n")
    return [path]


TASKS = (EvalTask("toy", "the mean of some numbers", _add,
                  lambda args, out: {"numbers": args.numbers, "bootstrap": args.bootstrap},
                  _run, _render, load=_load,
                  fingerprint=lambda model: {"model_type": "toy", "name_or_path": "toy",
                                             "num_hidden_layers": 0, "weights_digest": "0"}),)
'''


@pytest.fixture
def toy_folder(tmp_path, monkeypatch):
    """A task folder ``toy/`` outside the repository, on ``eval_harness``'s package path (as a
    folder ``eval_harness/toy/`` would be)."""
    folder = tmp_path / "harness" / "toy"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text('"""A toy task."""\n')
    (folder / "cli.py").write_text(textwrap.dedent(TOY_CLI))
    monkeypatch.setattr(eval_harness, "__path__", [*eval_harness.__path__, str(folder.parent)])
    tasks.cache_clear()
    yield folder
    tasks.cache_clear()
    for name in [m for m in sys.modules if m.startswith("eval_harness.toy")]:
        del sys.modules[name]


def test_a_task_in_its_own_folder_gets_a_subcommand_and_runs(toy_folder, tmp_path, capsys):
    text = _help(["eval", "toy"], capsys)
    assert "--numbers" in text and "--bootstrap" in text and "--traits" not in text
    out = tmp_path / "out"
    assert cli.main(["eval", "toy", "--numbers", "2,4", "--out", str(out)]) == 0
    assert "mean 3.0" in capsys.readouterr().out
    record = (out / "results.json").read_text()
    assert '"task": "toy"' in record and '"numbers": "2,4"' in record
    assert cli.main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text().endswith("mean 3.0\n")
