"""Steered vs plain throughput inside vLLM, and steered vLLM vs steered ``generate()``.

Run in the vLLM environment (``make vllm-env``)::

    OMP_NUM_THREADS=2 .venv-vllm/bin/python -m benchmarks.vllm.steering [--tokens 64]

Two engines run side by side (each in its own engine process, as ``LLM`` runs by default) and
serve the embedded SmolLM2-135M-Instruct in float32: stock vLLM (the plugin installed, no
registry: it does nothing) and vLLM with a registry holding the anxious bank set at the shipped N+
selector's sites. For 1, 8, 16 and 32 concurrent requests each decodes the same prompts, the
engines alternating round by round (``--repeats`` rounds, best tokens/s kept) so that load on a
shared machine hits both alike: the stock engine plain, the plugin engine plain and steered (every
request steered); then the same steered batch through transformers ``generate()`` under
``steer()``.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed

PROMPTS = ["Tell me about your plans for the weekend.", "What do you think about exams?",
           "Describe a walk in the forest.", "How do you feel before a job interview?"]


def build_registry(root: Path):
    import torch

    from hf_memory import BankSet, load_default_model
    from hf_memory.recipes.shipped import persona_bank, shipped_selector
    from hf_memory_vllm import write_registry

    model, tokenizer = load_default_model(dtype=torch.float32)
    BankSet([persona_bank(model, tokenizer, "I am anxious and I worry about everything.")],
            model=model).save_pretrained(root / "anxious")
    selector = shipped_selector("N+", model=model)
    selector.save_pretrained(root / "selector")
    registry = write_registry(root / "registry.json", model,
                              {"anxious": (root / "anxious", root / "selector")})
    return model, tokenizer, registry, selector


def start_engine(registry: Path | None, model_dir: Path, max_seqs: int):
    """An ``LLM`` whose engine process sees ``registry`` (None: stock vLLM)."""
    if registry is None:
        os.environ.pop("HF_MEMORY_VLLM_REGISTRY", None)
    else:
        os.environ["HF_MEMORY_VLLM_REGISTRY"] = str(registry)
    from vllm import LLM

    return LLM(str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
               kv_cache_memory_bytes=512 << 20, max_num_seqs=max_seqs)


def rate(llm, ids, batch: int, tokens: int, steered: bool) -> float:
    """Tokens/s of one batch of ``batch`` concurrent greedy requests."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hf_memory_vllm import cache_salt, steering_args

    extra = steering_args("anxious") if steered else None
    prompts, params = [], []
    for i in range(batch):
        prompt = TokensPrompt(prompt_token_ids=ids[i % len(ids)])
        if extra:
            prompt["cache_salt"] = cache_salt(extra)
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                     extra_args=extra))
    return batch * tokens / timed(lambda: llm.generate(prompts, params, use_tqdm=False))[1]


def vllm_rates(registry: Path, model_dir: Path, batches, tokens: int, repeats: int):
    """Best tokens/s per batch size and run (``stock``: no registry; ``plain`` and ``steered``:
    the plugin's engine), the engines alternating round by round."""
    stock = start_engine(None, model_dir, max(batches))
    plugin = start_engine(registry, model_dir, max(batches))
    tokenizer = stock.get_tokenizer()
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                         add_generation_prompt=True,
                                         return_dict=True)["input_ids"] for p in PROMPTS]
    runs = {"stock": (stock, False), "plain": (plugin, False), "steered": (plugin, True)}
    results = {}
    for batch in batches:
        best = dict.fromkeys(runs, 0.0)
        for _ in range(repeats):
            for mode, (llm, steered) in runs.items():
                best[mode] = max(best[mode], rate(llm, ids, batch, tokens, steered))
        results[batch] = best
    for llm in (stock, plugin):
        llm.llm_engine.engine_core.shutdown()
    return results


def generate_rate(model, tokenizer, selector, root: Path, batch: int, tokens: int) -> float:
    import torch

    from hf_memory import BankSet, steer

    banks = BankSet.from_pretrained(root / "anxious", model=model)
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % 4]}],
                                           tokenize=False, add_generation_prompt=True)
             for i in range(batch)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with steer(model, banks, selector=selector), torch.inference_mode():
        return batch * tokens / timed(lambda: model.generate(
            **inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False))[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--no-generate", action="store_true",
                        help="skip the transformers generate() comparison")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,8,16,32")
    add_jsonl_argument(parser, "vllm")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "vllm.steering", tokens=args.tokens, repeats=args.repeats)
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    from hf_memory.models.default_model import ensure_default_model_cached

    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.tokens} new tokens per request")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, tokenizer, registry, selector = build_registry(root)
        model_dir = Path(ensure_default_model_cached())
        rates = vllm_rates(registry, model_dir, batches, args.tokens, args.repeats)
        for batch in batches:
            plain, steered = rates[batch]["stock"], rates[batch]["steered"]
            print(f"vLLM  batch {batch:2d}: stock {plain:6.1f} tok/s; with the plugin: plain "
                  f"{rates[batch]['plain']:6.1f}, steered {steered:6.1f} tok/s; steered/stock "
                  f"{steered / plain:.2f}", flush=True)
            log.write(batch=batch, stock_tok_s=plain, plain_tok_s=rates[batch]["plain"],
                      steered_tok_s=steered, ratio=steered / plain)
        for batch in [] if args.no_generate else batches:
            generated = generate_rate(model, tokenizer, selector, root, batch, args.tokens)
            steered = rates[batch]["steered"]
            print(f"steered batch {batch:2d}: vLLM {steered:7.1f} tok/s, generate() "
                  f"{generated:7.1f} tok/s, vLLM/generate() {steered / generated:.1f}x", flush=True)
            log.write(batch=batch, steered_tok_s=steered, generate_tok_s=generated,
                      vllm_over_generate=steered / generated)


if __name__ == "__main__":
    main()
