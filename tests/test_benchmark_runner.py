"""The benchmark runner covers the CPU speed set, and the rows it leaves are stamped alike."""

from __future__ import annotations

import json

import pytest

from benchmarks import run
from benchmarks.results import ROOT, ResultLog


def test_the_runner_lists_every_cpu_benchmark_and_only_those():
    listed = {f"{subject}/{name}.py" for subject, entries in run.BENCHMARKS.items()
              for name, _ in entries}
    on_disk = {str(path.relative_to(ROOT / "benchmarks"))
               for subject in run.BENCHMARKS
               for path in (ROOT / "benchmarks" / subject).glob("*.py")
               if path.name != "__init__.py"}
    assert listed == on_disk


def test_result_rows_carry_the_benchmark_its_context_and_the_stamp(tmp_path):
    log = ResultLog(tmp_path / "out" / "x.jsonl", "asm.scan", threads=1)
    log.write(length=64, speedup=3.2)
    log.write(length=128, speedup=8.0)
    rows = [json.loads(line) for line in (tmp_path / "out" / "x.jsonl").read_text().splitlines()]
    assert [row["length"] for row in rows] == [64, 128]
    assert rows[0]["benchmark"] == "asm.scan" and rows[0]["threads"] == 1
    assert {"machine", "torch", "commit", "date"} <= rows[0].keys()


def test_counted_probes_counts_each_kind_and_restores_the_classes():
    from benchmarks.steering.persona_call_time import PROBES, counted_probes

    originals = {kind: cls.measure for kind, cls in PROBES.items()}
    with counted_probes() as counts:
        for kind in ("capability", "capability", "neutral"):
            with pytest.raises(AttributeError):  # a bare object is no probe: counted all the same
                PROBES[kind].measure(object(), None)
    assert counts["capability"][0] == 2 and counts["neutral"][0] == 1
    assert counts["objective"] == [0, 0.0]
    assert {kind: cls.measure for kind, cls in PROBES.items()} == originals
