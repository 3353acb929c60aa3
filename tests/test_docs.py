"""The documentation holds: the Sphinx site in ``docs/`` builds without a warning, and every code
block of ``README.md`` and of the pages under ``docs/`` keeps the code-block contract.

The contract, per page:

- ```` ```python ```` blocks run in order, concatenated, in one fresh interpreter from the repo
  root with ``HF_HUB_OFFLINE=1``, within 240 s per page;
- ```` ```bash ````, ```` ```console ```` and ```` ```shell ```` blocks are checked, not run: each
  command (after an optional ``$`` prompt — where a block has prompts, the lines without one are
  output; ``\\`` continuations joined; ``#`` comments skipped; leading ``VAR=value`` assignments
  set aside) is ``hf-memory ARGS`` that the real parser accepts (``--help`` lines: the subcommand
  path must exist), ``make TARGET...`` of Makefile targets, ``python -m MODULE`` of a module that
  resolves from the repo root (or, run by ``.venv-vllm/bin/python``, one of vLLM's), or starts
  with an allowed program (``ALLOWED_PREFIXES``);
- ```` ```yaml ````, ```` ```json ```` and ```` ```toml ```` blocks parse; ```` ```text ```` is
  output or data; a block without a language, or in another one, fails;
- pages under ``docs/benchmarks/``: only their ``python -m`` and ``make`` commands are checked,
  in shell blocks and in inline code spans (the tables name the command of each figure).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCHMARK_PAGES = DOCS / "benchmarks"
PYTHON_TIMEOUT_S = 240
SHELL = {"bash", "console", "shell"}


def _toml(text: str) -> object:
    import tomllib  # Python 3.11+ (the Makefile's environments); on 3.10 a toml block fails

    return tomllib.loads(text)


DATA = {"yaml": yaml.safe_load, "json": json.loads, "toml": _toml}
LANGUAGES = {"python", "text", *SHELL, *DATA}
ALLOWED_PREFIXES = ["git", "cd", "pip", "export", "vllm", "lm_eval", "python -c", "curl", "docker",
                    "ls", "cat", ".venv/bin/pip"]
VENV_BIN = r"(?:\.venv/bin/|\.venv-vllm/bin/)?"
PYTHON_M = re.compile(rf"^{VENV_BIN}python3?\s+-m\s+(\S+)")
HF_MEMORY = re.compile(rf"^{VENV_BIN}hf-memory(?:\s|$)")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Block:
    """A fenced block: its language (``""`` when none, ``{name}`` for a MyST directive), the
    line of its opening fence (1-based) and its text."""

    language: str
    line: int
    text: str


def fenced_blocks(markdown: str) -> list[Block]:
    """The fenced code blocks of a Markdown page; MyST directive fences (```` ```{toctree} ````)
    are not code, and the fences nested in them are read too."""
    blocks: list[Block] = []
    open_fences: list[tuple[str, Block, list[str]]] = []  # (fence, block, its lines)
    for number, line in enumerate(markdown.splitlines(), start=1):
        match = FENCE.match(line)
        if open_fences:
            fence, block, lines = open_fences[-1]
            closes = (match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)
                      and not match.group(2) and line.strip() == match.group(1))
            if closes:
                open_fences.pop()
                block.text = "\n".join(lines)
                continue
            if not block.language.startswith("{"):
                lines.append(line)
                continue
        if match:
            block = Block(match.group(2), number, "")
            blocks.append(block)
            open_fences.append((match.group(1), block, []))
    return [block for block in blocks if not block.language.startswith("{")]


def _open_quote(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return True
    return False


def commands(block: Block) -> list[tuple[int, str]]:
    """``(line, command)`` of a shell block: prompts stripped (where any line has one, the lines
    without one are output), continuations joined (a ``\\`` at the end of a line, or a quote
    left open), blank and comment lines dropped."""
    lines = block.text.splitlines()
    prompted = any(line.lstrip().startswith("$ ") for line in lines)
    found: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(lines, start=block.line + 1):
        line = raw.strip()
        if pending is None:
            if prompted and not line.startswith("$ "):
                continue
            line = line.removeprefix("$ ").strip()
            if not line or line.startswith("#"):
                continue
            pending = (number, "")
        start, text = pending
        if line.endswith("\\"):
            pending = (start, f"{text} {line[:-1].strip()}".strip())
        elif _open_quote(text := f"{text} {line}".strip()):
            pending = (start, f"{text}\n")
        else:
            found.append((start, text))
            pending = None
    if pending is not None:
        found.append(pending)
    return found


@cache
def _parser() -> argparse.ArgumentParser:
    from hf_memory_cli.main import build_parser

    return build_parser()


@cache
def makefile_targets() -> frozenset[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([^\s#:=$][^:=]*?)\s*:(?!=)", line)
        if match and not line.startswith("\t"):
            targets |= set(match.group(1).split())
    return frozenset(targets)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The direct subcommands of ``parser`` by name, aliases included."""
    return {name: sub for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def _subcommand_path_problem(words: list[str]) -> str | None:
    """Whether the words before a ``--help`` name a path of subcommands that exists."""
    parser = _parser()
    for word in words:
        if word.startswith("-"):
            break
        choices = _subcommands(parser)
        if word not in choices:
            return f"no subcommand {word!r} of {parser.prog!r} (has: {', '.join(choices)})"
        parser = choices[word]
    return None


def check_hf_memory(words: list[str]) -> str | None:
    """The problem of an ``hf-memory`` command line (its words after ``hf-memory``), or None."""
    helps = [index for index, word in enumerate(words) if word in ("--help", "-h")]
    if helps:
        return _subcommand_path_problem(words[:helps[0]])
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            _parser().parse_args(words)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return f"the parser refuses it: {stderr.getvalue().strip().splitlines()[-1]}"
    return None


def module_problem(module: str) -> str | None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"no module {module!r} (from the repo root or installed)"


def check_command(command: str, *, benchmarks: bool = False) -> str | None:
    """The problem of one shell command under the contract, or None (a page of
    ``docs/benchmarks/`` checks only ``python -m`` and ``make``)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError as error:
        return f"not a shell line ({error})"
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words:
        return None
    line = " ".join(words)
    if match := PYTHON_M.match(line):
        if words[0].startswith(".venv-vllm/") and match.group(1).split(".")[0] == "vllm":
            return None  # vLLM is installed in its own environment only (make vllm-env)
        return module_problem(match.group(1))
    if words[0] == "make":
        unknown = [word for word in words[1:] if not word.startswith("-")
                   and not ASSIGNMENT.match(word) and word not in makefile_targets()]
        return f"no Makefile target {', '.join(unknown)}" if unknown else None
    if benchmarks:
        return None
    if HF_MEMORY.match(line):
        return check_hf_memory(words[1:])
    if any(words[:len(prefix.split())] == prefix.split() for prefix in ALLOWED_PREFIXES):
        return None
    return ("not an allowed command (hf-memory, make, python -m, or a line starting with "
            f"{', '.join(ALLOWED_PREFIXES)})")


INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def check_page(markdown: str, name: str, *, benchmarks: bool = False) -> list[str]:
    """Every problem of a page's code blocks but running its Python, as ``name:line: ...``."""
    problems = []
    blocks = fenced_blocks(markdown)
    for block in blocks:
        where = f"{name}:{block.line}"
        if block.language not in LANGUAGES:
            problems.append(f"{where}: a fenced block in {block.language or 'no language'} "
                            f"(label it one of {', '.join(sorted(LANGUAGES))})")
        elif block.language in SHELL:
            for line, command in commands(block):
                if problem := check_command(command, benchmarks=benchmarks):
                    problems.append(f"{name}:{line}: `{command}`: {problem}")
        elif block.language in DATA and not benchmarks:
            try:
                DATA[block.language](block.text)
            except Exception as error:  # each parser raises its own error class
                message = " ".join(str(error).split())
                problems.append(f"{where}: the {block.language} block does not parse: {message}")
    if benchmarks:
        fenced = {line for block in blocks
                  for line in range(block.line, block.line + block.text.count("\n") + 3)}
        for number, text in enumerate(markdown.splitlines(), start=1):
            for span in INLINE_CODE.findall(text) if number not in fenced else ():
                if (PYTHON_M.match(span) or span.startswith("make ")) and (
                        problem := check_command(span, benchmarks=True)):
                    problems.append(f"{name}:{number}: `{span}`: {problem}")
    return problems


def python_code(markdown: str, name: str) -> str:
    """The page's python blocks, concatenated in order, each headed by where it comes from."""
    return "\n\n".join(f"# --- {name}:{block.line}\n{block.text}"
                       for block in fenced_blocks(markdown) if block.language == "python")


INCLUDE = re.compile(r"^ {0,3}(?:`{3,}|~{3,})\{include\}\s+(\S+)", re.MULTILINE)


def pages() -> list[Path]:
    """README.md, every page of ``docs/`` and every file a page includes (the per-folder READMEs
    the guides show), each checked as a page of its own."""
    found = sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts)
    included = {(page.parent / target).resolve() for page in found
                for target in INCLUDE.findall(page.read_text())}
    return [ROOT / "README.md", *found, *sorted(included - set(found))]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _is_benchmark_page(path: Path) -> bool:
    return BENCHMARK_PAGES in path.parents


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_code_blocks_keep_the_contract(page):
    problems = check_page(page.read_text(), _name(page), benchmarks=_is_benchmark_page(page))
    assert not problems, "\n".join(problems)


RUNNABLE = [page for page in pages()
            if not _is_benchmark_page(page) and python_code(page.read_text(), _name(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_python_blocks_run(page):
    code = python_code(page.read_text(), _name(page))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                capture_output=True, timeout=PYTHON_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{_name(page)}: its python blocks took over {PYTHON_TIMEOUT_S} s")
    assert result.returncode == 0, (
        f"{_name(page)}: its python blocks failed (line numbers count in the concatenated code; "
        f"each block starts at a '# --- FILE:LINE' line):\n{result.stderr[-4000:]}")


@pytest.mark.slow
def test_the_documentation_builds_without_a_warning(tmp_path):
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        cwd=ROOT, text=True, capture_output=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, f"sphinx-build -W failed:\n{result.stderr[-6000:]}"
    cli_page = (tmp_path / "html" / "cli" / "index.html").read_text()
    first_names = {id(sub): name for name, sub in reversed(_subcommands(_parser()).items())}
    missing = [name for name in first_names.values() if f"hf-memory {name}<" not in cli_page]
    assert missing == [], f"commands without a section in the CLI reference: {missing}"
    print(f"the documentation built in {time.perf_counter() - start:.0f} s")


CHECKER_PAGE = """# A page

```bash
$ hf-memory demo --help
hf-memory demo --help output, not a command
$ make test PYTEST_ARGS=-x
```

```console
python -m hf_memory_cli --help
git status
```

```json
{"a": 1}
```

```text
anything at all
```

```{toctree}
getting-started
```

```bash
hf-memory generate --no-such-flag
make no-such-target
.venv/bin/python -m no_such_module.at_all
rm -rf /
```

```
unlabelled
```

```yaml
a: [1
```
"""


def test_the_checker_passes_good_blocks_and_names_each_bad_one():
    problems = check_page(CHECKER_PAGE, "page.md")
    assert len(problems) == 6, "\n".join(problems)
    flag, target, module, program, unlabelled, yaml_ = problems
    assert flag.startswith("page.md:27: `hf-memory generate --no-such-flag`: the parser refuses")
    assert "--no-such-flag" in flag
    assert target == "page.md:28: `make no-such-target`: no Makefile target no-such-target"
    assert module.startswith("page.md:29:") and "no module 'no_such_module.at_all'" in module
    assert program.startswith("page.md:30: `rm -rf /`: not an allowed command")
    assert unlabelled.startswith("page.md:33: a fenced block in no language")
    assert yaml_.startswith("page.md:37: the yaml block does not parse")


def test_the_checker_joins_continued_lines_and_reads_prompts():
    block = Block("bash", 1, "curl -d '{\n  \"a\": 1}'\nls \\\n  -l\n# a comment")
    assert commands(block) == [(2, "curl -d '{\n \"a\": 1}'"), (4, "ls -l")]
    console = Block("console", 10, "$ make test\noutput line\n$ git status")
    assert commands(console) == [(11, "make test"), (13, "git status")]


def test_the_checker_reads_help_lines_environment_assignments_and_the_vllm_environment():
    assert check_command("hf-memory caa export control-vector --help") is None
    assert check_command("hf-memory caa no-such --help").startswith(
        "no subcommand 'no-such' of 'hf-memory caa'")
    assert check_command("hf-memory --version") is None
    assert check_command("HF_HUB_OFFLINE=1 make no-such") == "no Makefile target no-such"
    assert check_command(".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server") is None
    assert check_command(".venv/bin/python -m vllm.entrypoints.openai.api_server") is not None


def test_the_checker_runs_python_blocks_in_order_and_reads_benchmark_pages_commands_only():
    page = "```python\nx = 1\n```\n\ntext\n\n```python\nprint(x)\n```\n"
    assert python_code(page, "p.md") == "# --- p.md:1\nx = 1\n\n# --- p.md:7\nprint(x)"
    bench = ("| figure | command |\n|---|---|\n| 3 ms | `python -m no_such.bench --n 3` |\n"
             "| 4 ms | `make bench` |\n\n```bash\nanything-goes here\nmake nope\n```\n")
    assert check_page(bench, "b.md", benchmarks=True) == [
        "b.md:8: `make nope`: no Makefile target nope",
        "b.md:3: `python -m no_such.bench --n 3`: no module 'no_such.bench' "
        "(from the repo root or installed)"]
