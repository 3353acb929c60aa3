"""``package-tree``: one ``automodule`` section for every module below a package, found by
walking it, so the API reference follows the code without a hand-kept list of modules (and
writes no generated files into the source folder).

A package's own section is not indexed: its names are re-exports of its modules, which are, so
that every cross-reference (``:class:`AIRConfig```) has one target."""

from __future__ import annotations

import importlib
import pkgutil

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def modules_below(package: str) -> list[tuple[str, bool]]:
    """``(name, is_package)`` of every public module under ``package`` (not the package itself),
    sorted: names with a leading underscore and ``__main__`` (running it would start a program)
    are left out."""
    path = importlib.import_module(package).__path__
    return sorted(
        (info.name, info.ispkg) for info in pkgutil.walk_packages(path, prefix=f"{package}.")
        if not any(part.startswith("_") for part in info.name.split("."))
    )


class PackageTree(SphinxDirective):
    """``.. package-tree:: PACKAGE``: a section per module below PACKAGE with its members."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        lines = []
        for module, is_package in modules_below(self.arguments[0]):
            lines += [module, "-" * len(module), "", f".. automodule:: {module}"]
            lines += ["   :no-index:", ""] if is_package else [""]
        source = self.get_source_info()[0]
        content = StringList(lines, source=source)
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, content, container)
        return container.children


def setup(app):
    app.add_directive("package-tree", PackageTree)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
