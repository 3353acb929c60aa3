"""Steered lm-eval in data parallel: ``accelerate launch -m eval_harness.lm_eval_model`` with two
processes (gloo, on the CPU) gives the per-task results and per-document scores of one process,
and scores every document exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from hf_memory import BankSet  # noqa: E402
from hf_memory.models.embedded import ensure_embedded_model_cached  # noqa: E402
from hf_memory.recipes.demo import shipped_selector  # noqa: E402
from hf_memory.recipes.shipped import persona_bank
from tests.test_multiprocess_training import ROOT, free_port  # noqa: E402

TASK, LIMIT = "hfm_trait_pairs", 10
LAUNCH_TIMEOUT_S = 300


def lm_eval(out: Path, model_args: str, processes: int) -> dict:
    # ACCELERATE_USE_CPU: without it each process of a CPU-only launch makes a one-process
    # Accelerator (lm-eval's HFLM asks for none on the CPU), and every process scores everything
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "ACCELERATE_USE_CPU": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launcher = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                 "--num_processes", str(processes), "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no",
                 "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), "-m"]
                if processes > 1 else [sys.executable, "-m"])
    command = [*launcher, "eval_harness.lm_eval_model", "--model", "hf-memory", "--model_args",
               model_args, "--tasks", TASK, "--include_path", "eval_harness/lm_eval_model/tasks",
               "--limit", str(LIMIT), "--batch_size", "4", "--log_samples",
               "--output_path", str(out), "--seed", "0"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, f"lm-eval ({processes} processes) failed:\n{done.stderr[-4000:]}"
    results = list(out.rglob("results_*.json"))
    samples = list(out.rglob(f"samples_{TASK}_*.jsonl"))
    assert len(results) == 1 and len(samples) == 1, (results, samples)
    return {"log": done.stderr,"results": json.loads(results[0].read_text())["results"][TASK],
            "samples": [json.loads(line) for line in samples[0].read_text().splitlines()]}


@pytest.mark.slow
def test_two_processes_score_every_document_once_and_equal_one(default_model, tmp_path):
    model, tokenizer = default_model
    BankSet([persona_bank(model, tokenizer, "You are extremely anxious and worried.")],
            model=model).save_pretrained(tmp_path / "banks")
    shipped_selector("N+", model).save_pretrained(tmp_path / "selector")
    model_args = (f"pretrained={ensure_embedded_model_cached('smollm2-135m-instruct')},"
                  f"banks={tmp_path / 'banks'},selector={tmp_path / 'selector'}")
    one = lm_eval(tmp_path / "one", model_args, 1)
    two = lm_eval(tmp_path / "two", model_args, 2)
    for rank in (0, 1):  # each process built and ran its own half of the requests
        assert f"Building contexts for {TASK} on rank {rank}" in two["log"]
    assert f"{LIMIT}/{LIMIT}" in two["log"] and f"{2 * LIMIT}/{2 * LIMIT}" not in two["log"]
    ids = [s["doc_id"] for s in two["samples"]]
    assert sorted(ids) == list(range(LIMIT)), "a document was scored twice or not at all"
    by_doc = {s["doc_id"]: s for s in one["samples"]}
    for sample in two["samples"]:
        want = by_doc[sample["doc_id"]]
        assert sample["acc"] == want["acc"]
        for got, ref in zip(sample["resps"], want["resps"], strict=True):
            assert abs(float(got[0][0]) - float(ref[0][0])) < 1e-4  # log-likelihoods, float32
    assert two["results"]["acc,none"] == one["results"]["acc,none"]
