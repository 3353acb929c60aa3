"""``hf-memory eval <task>`` and ``hf-memory report <results>``.

One subcommand per task of :func:`eval_harness.registry.tasks`, each with that task's flags only
(declared in its folder's ``cli.py``); ``hf-memory eval --suite YAML`` runs a suite file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eval_harness.arguments import add_shared
from eval_harness.registry import EvalTask, tasks

from .model_loading import load_model

__all__ = ["add_eval_parsers"]


class _TaskParser(argparse.ArgumentParser):
    """A task's parser: a flag it does not take fails naming the tasks that do."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for word in extras:
            flag = word.split("=", 1)[0]
            takers = [name for name, parser in self._siblings.items()
                      if flag in parser._option_string_actions]
            if takers:
                self.error(f"{flag} is a {' / '.join(takers)} option, not {self._task}'s")
        return namespace, extras


def _run(task: EvalTask, args: argparse.Namespace) -> Path:
    """Build the task's config, load its model, run it and write ``results.json``."""
    from eval_harness.runner import run_task

    out = Path(args.out or f"results/{task.name}")
    config = task.build_config(args, out)
    model, tokenizer = task.load(args) if task.load else load_model(args.model)
    return run_task(task.name, lambda: task.run(model, tokenizer, config, args.seed),
                    model=model, config=task.record(config, args), seed=args.seed, out=out,
                    fingerprint=task.fingerprint(model) if task.fingerprint else None)


def _suite(args: argparse.Namespace) -> None:
    """Run every entry of a suite file through ``eval`` and compare them in one report."""
    import yaml

    from eval_harness.suite_report import render_suite_report

    try:
        suite = yaml.safe_load(Path(args.suite).read_text())
    except OSError as error:
        raise ValueError(f"cannot read the suite {args.suite}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{args.suite} is not valid YAML: {str(error).splitlines()[0]}"
                         ) from None
    runs = suite.get("runs") if isinstance(suite, dict) else None
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and "task" in r
                                                         for r in runs):
        raise ValueError(f"{args.suite} needs a list 'runs' of entries with a 'task' (and "
                         "'model', 'args')")
    out = Path(args.suite_out or suite.get("out") or "results/suite")
    paths = []
    for i, run in enumerate(runs):
        argv = [str(run["task"]), "--model", str(run.get("model", "default"))]
        for key, value in (run.get("args") or {}).items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        target = out / f"{i:02d}-{run['task']}"
        entry = args.eval_parser.parse_args([*argv, "--out", str(target)])
        print(f"# suite {i + 1}/{len(runs)}: hf-memory eval {' '.join(argv)}")
        _eval(entry)
        paths.append(target / "results.json")
    for path in render_suite_report(paths, out):
        print(f"# wrote {path}")


def _eval(args: argparse.Namespace) -> None:
    if args.suite is not None:
        if args.task is not None:
            raise ValueError("give a task or --suite, not both")
        return _suite(args)
    if args.task is None:
        raise ValueError("give a task (see hf-memory eval --help) or --suite FILE")
    from eval_harness.report import render_report

    args.out = args.out or args.suite_out  # ``eval --out DIR TASK``, the old order
    path = _run(tasks()[args.task], args)
    print(f"# wrote {path}")
    for report in render_report(path):
        print(f"# wrote {report}")
    print((path.parent / "report.md").read_text())


def _report(args: argparse.Namespace) -> None:
    from eval_harness.report import render_report

    for path in render_report(args.results, args.out):
        print(path)


def add_eval_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``eval`` (a subcommand per registered task) and ``report`` on the
    ``hf-memory`` parser."""
    run = commands.add_parser(
        "eval", help="run an evaluation task and write results.json + report",
        description="Run a task and render its report (Markdown tables + PNG plots); "
                    "`hf-memory eval TASK --help` lists the task's flags.")
    run.add_argument("--suite", metavar="YAML",
                     help="run the suite file's entries (runs: [{task, model, args}], out) and "
                          "write one side-by-side report")
    run.add_argument("--out", dest="suite_out", metavar="DIR",
                     help="with --suite: the suite's output directory (default: the file's "
                          "out, else results/suite)")
    run.set_defaults(handler=_eval, eval_parser=run, task=None)
    subcommands = run.add_subparsers(dest="task", metavar="TASK", parser_class=_TaskParser)
    parsers: dict[str, _TaskParser] = {}
    for name, task in tasks().items():
        parser = subcommands.add_parser(name, help=task.summary,
                                        description=f"{name}: {task.summary}.")
        parser._task, parser._siblings = name, parsers
        task.add_arguments(parser)
        add_shared(parser, "--model", "--seed", "--out")
        parsers[name] = parser

    report = commands.add_parser("report", help="render tables and plots from a results.json",
                                 description="Render report.md and PNG plots from results.")
    report.add_argument("results", help="a results.json or the directory holding it")
    report.add_argument("--out", metavar="DIR", help="where to write (default: beside it)")
    report.set_defaults(handler=_report)
