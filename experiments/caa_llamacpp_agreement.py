"""Our CAA exported as a llama.cpp control vector, run in llama.cpp itself on the same model.

The embedded SmolLM2-135M-Instruct is a Q4_1 GGUF: transformers runs it de-quantized, llama.cpp
runs it quantized. Block-output CAA vectors are extracted from contrastive pairs, exported with
``export_control_vector`` and then, on the same chat prompts (the same token ids):

- next-token logits: the steered − plain change in transformers (``apply_caa``, every position)
  against the change in llama.cpp (llama-cpp-python, the control vector set through
  ``llama_set_adapter_cvec`` with the buffer laid out as llama.cpp's own loader lays it out):
  Pearson correlation per prompt and the largest gap;
- greedy replies: transformers against the ``llama-completion`` binary run with
  ``--control-vector FILE`` (llama.cpp's own GGUF loader), steered and plain.

The llama.cpp side runs in its own environment (``make llamacpp-env``)::

    .venv/bin/python -m experiments.caa_llamacpp_agreement            # both sides, the table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_PY = ROOT / ".venv-llamacpp" / "bin" / "python"
COMPLETION = ROOT / ".venv-llamacpp" / "build" / "bin" / "llama-completion"
PAIRS = [("I feel wonderful, joyful and full of delight today!",
          "I feel awful, gloomy and full of sorrow today."),
         ("What a fantastic, happy, sunny day it is!", "What a terrible, sad, dreary day it is."),
         ("Everything makes me smile and laugh with joy.",
          "Everything makes me frown and weep with grief."),
         ("I love life; it is bright and cheerful.", "I hate life; it is dark and miserable."),
         ("Great news! I am thrilled and grateful.", "Bad news. I am crushed and bitter.")]
PROMPTS = ["How was your weekend?", "Describe the weather today.", "What do you think of Mondays?",
           "Tell me about your job.", "How do you feel about the future?",
           "What did you eat for breakfast?", "Describe your neighbourhood.",
           "What is your opinion of rain?", "How was the traffic this morning?",
           "Tell me about a movie you watched.", "What are your plans for tonight?",
           "How do you like your coffee?", "Describe a typical school day.",
           "What do you think about winter?", "Tell me about your family.",
           "How was your last holiday?"]


def transformers_side(out: Path, layers: list[int], scale: float, tokens: int) -> dict:
    import torch

    from hf_memory import CAAVectors, apply_caa, export_control_vector, load_default_model
    from hf_memory.models.default_model import gguf_path

    torch.set_num_threads(1)
    model, tokenizer = load_default_model()
    vectors = CAAVectors.extract(model, tokenizer, PAIRS, layers=layers, scale=scale,
                                 site="block_output")
    export_control_vector(vectors, out / "vector.gguf")
    rows = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        row = {"prompt": prompt, "text": text, "ids": ids[0].tolist()}
        for name, steering in (("plain", None), ("steered", vectors)):
            with torch.no_grad():
                if steering is None:
                    logits = model(ids).logits[0, -1]
                    reply = model.generate(ids, max_new_tokens=tokens, do_sample=False)
                else:
                    with apply_caa(model, steering):
                        logits = model(ids).logits[0, -1]
                        reply = model.generate(ids, max_new_tokens=tokens, do_sample=False)
            row[f"{name}_logits"] = logits.tolist()
            row[f"{name}_reply"] = tokenizer.decode(reply[0, ids.shape[1]:],
                                                    skip_special_tokens=True)
        rows.append(row)
    return {"gguf": str(gguf_path()), "rows": rows, "layers": layers, "scale": scale,
            "num_layers": model.config.num_hidden_layers}


def _cvec_buffer(path: Path):
    """The flat float32 buffer llama.cpp's ``common_control_vector_load`` builds from a file:
    layer ``n`` (n >= 1) at offset ``n_embd · (n − 1)``, repeated layers summed."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    directions = {int(t.name.split(".")[1]): np.array(t.data, dtype=np.float32)
                  for t in reader.tensors}
    width = len(next(iter(directions.values())))
    buffer = np.zeros(width * max(directions), dtype=np.float32)
    for layer, direction in directions.items():
        buffer[width * (layer - 1): width * layer] += direction
    return buffer, width


def llamacpp_side(out: Path, tokens: int) -> dict:
    import ctypes

    import llama_cpp
    import numpy as np

    record = json.loads((out / "transformers.json").read_text())
    llm = llama_cpp.Llama(record["gguf"], n_ctx=512, n_threads=1, logits_all=True,
                          verbose=False)
    buffer, width = _cvec_buffer(out / "vector.gguf")
    pointer = buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def last_logits(ids: list[int]) -> list[float]:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64).tolist()

    rows = []
    for row in record["rows"]:
        result = {"plain_logits": last_logits(row["ids"])}
        status = llama_cpp.llama_set_adapter_cvec(llm.ctx, pointer, buffer.size, width, 1,
                                                  record["num_layers"])
        if status != 0:
            raise RuntimeError(f"llama_set_adapter_cvec returned {status}")
        result["steered_logits"] = last_logits(row["ids"])
        llama_cpp.llama_set_adapter_cvec(llm.ctx, None, 0, width, -1, -1)  # plain again
        for name, extra in (("plain", []), ("steered", ["--control-vector",
                                                        str(out / "vector.gguf")])):
            completed = subprocess.run(
                [str(COMPLETION), "-m", record["gguf"], "-p", row["text"], "-n", str(tokens),
                 "--temp", "0", "-t", "1", "-no-cnv", "--no-display-prompt", "--no-warmup",
                 "-c", "512", "--simple-io", *extra],
                capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
            if completed.returncode != 0:
                raise RuntimeError(f"llama-completion failed: {completed.stderr[-2000:]}")
            result[f"{name}_reply"] = completed.stdout.strip()
        rows.append(result)
    return {"rows": rows}


def _pearson(a, b) -> float:
    import numpy as np

    return float(np.corrcoef(np.asarray(a), np.asarray(b))[0, 1])


def compare(hf: dict, cpp: dict) -> dict:
    import numpy as np

    correlations, gaps, spans, plain_corr, same, same_plain, moved = [], [], [], [], 0, 0, 0
    for ours, theirs in zip(hf["rows"], cpp["rows"], strict=True):
        ours_delta = np.subtract(ours["steered_logits"], ours["plain_logits"])
        theirs_delta = np.subtract(theirs["steered_logits"], theirs["plain_logits"])
        correlations.append(_pearson(ours_delta, theirs_delta))
        gaps.append(float(np.abs(ours_delta - theirs_delta).max()))
        spans.append(float(np.abs(ours_delta).max()))
        plain_corr.append(_pearson(ours["plain_logits"], theirs["plain_logits"]))
        same += ours["steered_reply"].strip() == theirs["steered_reply"].strip()
        same_plain += ours["plain_reply"].strip() == theirs["plain_reply"].strip()
        moved += ours["steered_reply"] != ours["plain_reply"]
    return {"prompts": len(correlations), "delta_corr_median": float(np.median(correlations)),
            "delta_corr_min": min(correlations), "largest_gap": max(gaps),
            "largest_change": max(spans), "plain_logit_corr_min": min(plain_corr),
            "greedy_same_steered": same, "greedy_same_plain": same_plain,
            "transformers_replies_moved": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("both", "transformers", "llama-cpp"), default="both")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "llamacpp")
    parser.add_argument("--layers", default="10")
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per reply")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.side == "llama-cpp":
        result = llamacpp_side(args.out, args.tokens)
        (args.out / "llamacpp.json").write_text(json.dumps(result))
        return
    start = time.perf_counter()
    hf = transformers_side(args.out, [int(x) for x in args.layers.split(",")], args.scale,
                           args.tokens)
    (args.out / "transformers.json").write_text(json.dumps(hf))
    if args.side == "transformers":
        return
    if not LLAMACPP_PY.exists() or not COMPLETION.exists():
        sys.exit("the llama.cpp environment is missing: make llamacpp-env")
    subprocess.run([str(LLAMACPP_PY), "-m", "experiments.caa_llamacpp_agreement", "--side",
                    "llama-cpp", "--out", str(args.out), "--tokens", str(args.tokens)], check=True,
                   cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    cpp = json.loads((args.out / "llamacpp.json").read_text())
    summary = {"layers": hf["layers"], "scale": hf["scale"], **compare(hf, cpp),
               "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(summary))
    for ours, theirs in zip(hf["rows"], cpp["rows"], strict=True):
        print(json.dumps({"prompt": ours["prompt"], "transformers": ours["steered_reply"],
                          "llama.cpp": theirs["steered_reply"],
                          "plain": ours["plain_reply"]}, ensure_ascii=False))


if __name__ == "__main__":
    main()
