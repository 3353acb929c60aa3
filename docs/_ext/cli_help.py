"""``cli-help``: the command-line reference, one section per command and subcommand at every
depth, each holding what ``--help`` prints for it.

The parsers are walked as they are built (``hf_memory_cli.main.build_parser``), so a new command
or eval task shows up without touching the docs. The help is shown as printed, in a literal
block: argparse help strings are terminal text (``|m_i| > T * max|m|``), and sphinx-argparse,
which reads them as reST, warns on them — making them valid reST would change ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Iterator
from unittest import mock

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

WIDTH = "100"  # columns argparse wraps the help to, whatever the terminal of the build


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(name, parser)`` of each direct subcommand, in the order ``--help`` lists them (an alias
    of a command already listed is skipped)."""
    seen = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield name, sub


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(path, parser)`` of ``parser`` and every subcommand below it, depth first."""
    yield path, parser
    for name, sub in subcommands(parser):
        yield from walk(sub, (*path, name))


class CLIHelp(SphinxDirective):
    """``.. cli-help:: MODULE:FUNCTION``: sections of the ``--help`` of the parser it builds."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module, function = self.arguments[0].split(":")
        parser = getattr(importlib.import_module(module), function)()
        sections: dict[tuple[str, ...], nodes.Element] = {}
        top: list[nodes.Node] = []
        with mock.patch.dict(os.environ, {"COLUMNS": WIDTH}):
            for path, sub in walk(parser):
                text = sub.format_help()
                title = " ".join((parser.prog, *path))
                section = nodes.section(ids=[nodes.make_id(f"cli {title}")])
                section += nodes.title(text=title)
                section += nodes.literal_block(text, text, language="text")
                if path:
                    sections[path[:-1]] += section
                else:
                    top.append(section)
                sections[path] = section
        return top


def setup(app):
    app.add_directive("cli-help", CLIHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
