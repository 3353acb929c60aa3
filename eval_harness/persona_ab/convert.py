"""Convert steering-bench's persona A/B sets into the compact form shipped in ``data/``.

``python -m eval_harness.persona_ab.convert SOURCE [--out DIR]`` reads SOURCE (steering-bench's
``assets/processed_datasets/mwe_persona/`` layout: one JSON list per set and
``persona_prompts.json``) and writes, per set, ``<set>.jsonl.gz``: one JSON object a line with
only ``prompt``, ``positive`` and ``negative`` (the answers ``"(A)"`` / ``"(B)"``), in the
source's order; and ``persona_prompts.json`` (set -> positive / negative system prompt) for the
converted sets. The output is byte-for-byte deterministic (gzip mtime 0, no file name in the
gzip header, sorted keys), so a re-conversion shows no diff.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["DATA_DIR", "convert", "convert_item", "main", "write_jsonl_gz"]

DATA_DIR = Path(__file__).parent / "data"
ANSWERS = ("(A)", "(B)")


def convert_item(item: Any, where: str) -> dict[str, str]:
    """One source item as ``{"prompt", "positive", "negative"}``; a ``ValueError`` naming
    ``where`` if it is not steering-bench's format (one prompt, two different A/B answers)."""
    try:
        positive, negative = item["positive"], item["negative"]
        prompt, answers = positive["prompt"], (positive["response"], negative["response"])
    except (KeyError, TypeError):
        raise ValueError(f"{where}: not a steering-bench item (needs positive / negative "
                         "prompt and response)") from None
    if negative["prompt"] != prompt or not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: the positive and negative prompts must be the same "
                         "non-empty text")
    if sorted(answers) != list(ANSWERS):
        raise ValueError(f"{where}: the answers must be (A) and (B), one each; got {answers}")
    return {"prompt": prompt, "positive": answers[0], "negative": answers[1]}


def write_jsonl_gz(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as gzip'd JSON lines, deterministic bytes (mtime 0, no embedded file name)."""
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9,
                       mtime=0) as handle:
        handle.write(text.encode("utf-8"))
    path.write_bytes(buffer.getvalue())
    return path


def convert(source: str | Path, out: str | Path = DATA_DIR) -> list[Path]:
    """Convert every set of ``source`` that has persona prompts; return the written files."""
    source, out = Path(source), Path(out)
    try:
        prompts = json.loads((source / "persona_prompts.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {source / 'persona_prompts.json'}: {error}") from None
    sets = sorted(p.stem for p in source.glob("*.json") if p.name != "persona_prompts.json")
    missing = [s for s in sets if s not in prompts]
    if not sets or missing:
        raise ValueError(f"{source}: no sets found" if not sets else
                         f"{source}: sets without persona prompts: {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in sets:
        items = json.loads((source / f"{name}.json").read_text())
        if not isinstance(items, list) or not items:
            raise ValueError(f"{source / name}.json must hold a non-empty JSON list")
        rows = [convert_item(item, f"{name}.json item {i}") for i, item in enumerate(items)]
        written.append(write_jsonl_gz(out / f"{name}.jsonl.gz", rows))
    kept = {name: {"positive_system_prompt": prompts[name]["positive_system_prompt"],
                   "negative_system_prompt": prompts[name]["negative_system_prompt"]}
            for name in sets}
    path = out / "persona_prompts.json"
    path.write_text(json.dumps(kept, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return [*written, path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval_harness.persona_ab.convert",
        description="Convert steering-bench's mwe_persona sets into the compact shipped form.")
    parser.add_argument("source", help="folder of <set>.json files and persona_prompts.json")
    parser.add_argument("--out", default=str(DATA_DIR),
                        help="where to write (default: the package's data folder)")
    args = parser.parse_args(argv)
    try:
        paths = convert(args.source, args.out)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
