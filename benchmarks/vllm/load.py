"""The steering vLLM server under load: throughput, latency, and not one wrong output.

Run in the vLLM environment (``make vllm-env``), loopback only; it stops by itself::

    OMP_NUM_THREADS=2 .venv-vllm/bin/python -m benchmarks.vllm.load [--clients 1,8,32]
        [--tensor-parallel-size 2]

The embedded SmolLM2-135M-Instruct in float32 behind vLLM's OpenAI-compatible server with a
registry of three bank sets (anxious and calm at their shipped selectors, and a contrastive
anxious-vs-calm pair). For each client count, ``--requests`` requests go out, mixing plain,
steered (three bank sets, one at half gain) and malformed ones (unknown bank set, a scale that
is no number, an unknown steering argument). Every valid reply must equal the same request's
offline output (vLLM's ``LLM`` in one process, computed first) and every malformed one must get
its HTTP 400; with ``--tensor-parallel-size N`` the server runs N workers (on the CPU backend
each bound to its own core, ``VLLM_CPU_OMP_THREADS_BIND``) and must still equal one process.
Then the engine process is killed mid-load: each client must see an error or its
correct text, never other text; a restarted server must serve correctly again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed

PROMPTS = ["Tell me about your plans for the weekend.", "What do you think about exams?",
           "Describe a walk in the forest.", "How do you feel before a job interview?"]
VALID = {"plain": None, "anxious": {"memory_bank_set": "anxious"},
         "calm": {"memory_bank_set": "calm"}, "contrast": {"memory_bank_set": "contrast"},
         "anxious-half": {"memory_bank_set": "anxious", "memory_scale": 0.5}}
MALFORMED = {"unknown-set": {"memory_bank_set": "excited"},
             "bad-scale": {"memory_bank_set": "calm", "memory_scale": "loud"},
             "unknown-arg": {"memory_bank_set": "calm", "memory_gain": 2}}
START_TIMEOUT = 300


def build_registry(root: Path):
    import torch

    from hf_memory import BankSet, load_default_model
    from hf_memory.recipes.shipped import persona_bank, shipped_selector
    from hf_memory_vllm import write_registry

    model, tokenizer = load_default_model(dtype=torch.float32)
    anxious, calm = ("I am anxious and I worry about everything.",
                     "I am calm and relaxed, and nothing worries me.")
    sets = {"anxious": [persona_bank(model, tokenizer, anxious)],
            "calm": [persona_bank(model, tokenizer, calm)],
            "contrast": [persona_bank(model, tokenizer, anxious),
                         persona_bank(model, tokenizer, calm, role="reference",
                                      name="reference")]}
    artifacts = {}
    for name, banks in sets.items():
        BankSet(banks, model=model).save_pretrained(root / name)
        direction = "N-" if name == "calm" else "N+"
        shipped_selector(direction, model=model).save_pretrained(root / f"{name}-selector")
        artifacts[name] = (root / name, root / f"{name}-selector")
    return tokenizer, write_registry(root / "registry.json", model, artifacts)


def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                          add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for p in PROMPTS]


def offline_outputs(model_dir: Path, registry: Path, ids, lengths: tuple[int, ...]) -> dict:
    """(kind, prompt index, new tokens) → text, from vLLM's offline ``LLM`` with the same
    registry."""
    os.environ["HF_MEMORY_VLLM_REGISTRY"] = str(registry)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hf_memory_vllm import cache_salt

    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              kv_cache_memory_bytes=256 << 20)
    keys, prompts, params = [], [], []
    for kind, extra in VALID.items():
        for i, prompt in enumerate(ids):
            for tokens in lengths:
                request = TokensPrompt(prompt_token_ids=prompt)
                if extra:
                    request["cache_salt"] = cache_salt(extra)
                keys.append((kind, i, tokens))
                prompts.append(request)
                params.append(SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                             extra_args=extra))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return {key: out.outputs[0].text for key, out in zip(keys, outputs, strict=True)}


def start_server(model_dir: Path, registry: Path, log: Path,
                 tensor_parallel: int = 1) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", "smollm2", "--dtype", "float32",
               "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20)]
    env = {**os.environ, "HF_MEMORY_VLLM_REGISTRY": str(registry)}
    if tensor_parallel > 1:
        command += ["--tensor-parallel-size", str(tensor_parallel),
                    "--distributed-executor-backend", "mp"]
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tensor_parallel))))
    with open(log, "w") as sink:
        process = subprocess.Popen(command, env=env,
                                   stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                if reply.status == 200:
                    return process, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            raise RuntimeError(f"no server after {START_TIMEOUT} s: {log.read_text()[-3000:]}")
        time.sleep(1)


def stop_server(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def complete(base: str, prompt: list[int], extra: dict | None, tokens: int):
    """(HTTP status or None for a dropped connection, text or error message, seconds)."""
    from hf_memory_vllm import RegistryError, cache_salt

    body = {"model": "smollm2", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    if extra is not None:
        body["vllm_xargs"] = extra
        try:
            body["cache_salt"] = cache_salt(extra)
        except RegistryError:
            pass  # a malformed request: the server must refuse it
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            text = json.loads(reply.read())["choices"][0]["text"]
            return reply.status, text, time.perf_counter() - start
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace"), time.perf_counter() - start
    except OSError as error:  # connection refused or reset
        return None, str(error), time.perf_counter() - start


def workload(count: int) -> list[tuple[str, int]]:
    """``count`` (kind, prompt index) requests: valid kinds in turn, every fourth malformed."""
    valid, malformed = list(VALID), list(MALFORMED)
    return [(malformed[(i // 4) % len(malformed)] if i % 4 == 3 else valid[i % len(valid)],
             i % len(PROMPTS)) for i in range(count)]


def run_load(base: str, ids, expected: dict, clients: int, count: int, tokens: int) -> dict:
    jobs = workload(count)

    def send(job):
        kind, i = job
        return job, complete(base, ids[i], VALID.get(kind, MALFORMED.get(kind)), tokens)

    with ThreadPoolExecutor(clients) as pool:
        results, wall = timed(lambda: list(pool.map(send, jobs)))
    wrong, refused_ok, latencies = [], 0, []
    for (kind, i), (status, text, seconds) in results:
        if kind in MALFORMED:
            refused_ok += status == 400
            if status != 400:
                wrong.append((kind, i, status))
        elif status != 200 or text != expected[(kind, i, tokens)]:
            wrong.append((kind, i, status))
        else:
            latencies.append(seconds)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return {"clients": clients, "requests": count, "valid_ok": len(latencies),
            "malformed_400": refused_ok, "wrong": wrong, "wall_s": wall,
            "tokens_per_s": len(latencies) * tokens / wall,
            "p50_s": statistics.median(latencies), "p99_s": p99}


def kill_engine_mid_load(base: str, server: subprocess.Popen, ids, expected: dict,
                         tokens: int) -> dict:
    """Kill the engine process while 16 requests are in flight; count what the clients saw."""
    import psutil

    jobs = [(kind, i) for kind in VALID for i in range(len(PROMPTS))][:16]
    results = []

    def send(job):
        kind, i = job
        results.append(((kind, i, tokens), complete(base, ids[i], VALID[kind], tokens)))

    threads = [threading.Thread(target=send, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    time.sleep(3)
    engines = psutil.Process(server.pid).children(recursive=True)
    for engine in engines:
        engine.kill()
    for thread in threads:
        thread.join(timeout=300)
    errors = sum(status != 200 for _, (status, _, _) in results)
    wrong = [job for job, (status, text, _) in results
             if status == 200 and text != expected[job]]
    return {"in_flight": len(jobs), "killed_processes": len(engines), "errors": errors,
            "completed": len(jobs) - errors, "wrong": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="server workers (the offline reference stays one process)")
    add_jsonl_argument(parser, "vllm")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "vllm.load", tokens=args.tokens,
                    tensor_parallel_size=args.tensor_parallel_size)

    import torch

    from hf_memory.models.default_model import ensure_default_model_cached

    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.requests} requests per client count, "
          f"{args.tokens} new tokens each; a quarter malformed; server tensor parallel "
          f"{args.tensor_parallel_size}", flush=True)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer, registry = build_registry(root)
        model_dir = Path(ensure_default_model_cached())
        ids = prompt_ids(tokenizer)
        long = args.tokens * 8  # the requests in flight when the engine is killed
        expected = offline_outputs(model_dir, registry, ids, (args.tokens, long))
        server, base = start_server(model_dir, registry, root / "server.log",
                                    args.tensor_parallel_size)
        try:
            for clients in (int(c) for c in args.clients.split(",")):
                result = run_load(base, ids, expected, clients, args.requests, args.tokens)
                failures += len(result["wrong"])
                log.write(phase="load", **result)
                print(f"clients {clients:2d}: {result['valid_ok']} valid replies identical to "
                      f"offline, {result['malformed_400']} malformed got 400, wrong "
                      f"{len(result['wrong'])} {result['wrong'][:4]}; "
                      f"{result['tokens_per_s']:.1f} tok/s, p50 {result['p50_s']:.2f} s, "
                      f"p99 {result['p99_s']:.2f} s, wall {result['wall_s']:.1f} s", flush=True)
            killed = kill_engine_mid_load(base, server, ids, expected, long)
            failures += len(killed["wrong"])
            log.write(phase="engine killed mid-load", **killed)
            print(f"engine killed mid-load ({killed['killed_processes']} processes): "
                  f"{killed['errors']} of {killed['in_flight']} in-flight requests got an error, "
                  f"{killed['completed']} completed, wrong text {len(killed['wrong'])}",
                  flush=True)
        finally:
            stop_server(server)
        server, base = start_server(model_dir, registry, root / "restarted.log",
                                    args.tensor_parallel_size)
        try:
            result = run_load(base, ids, expected, 4, len(VALID) * len(PROMPTS), args.tokens)
            failures += len(result["wrong"])
            log.write(phase="restarted server", **result)
            print(f"restarted server: {result['valid_ok']} valid replies identical to offline, "
                  f"{result['malformed_400']} malformed got 400, wrong {len(result['wrong'])}",
                  flush=True)
        finally:
            stop_server(server)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
