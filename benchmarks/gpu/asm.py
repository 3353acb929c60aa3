"""ASM on a CUDA GPU, in one process: the Triton scans against the chunked PyTorch path.

* one ASM-57M layer's scan + read (``asa_attend``: write scan, content-scored read weights,
  read), forward + backward, bf16 inputs, T x B grid: the chunk-parallel Triton kernels (chunks
  of 16, 32, 64), the recurrent Triton kernels, chunked PyTorch and the per-token loop of
  ``benchmarks/asm/scan.py`` (short T only); tokens/s and peak memory; and
  flash-linear-attention's ``chunk_gsa`` (gated slot attention: a slot memory written through a
  softmax over slots, the closest kernel we know) on the same B, T, heads and slots, where fla
  imports (its own section: its first calls autotune for minutes);
* the whole ASM-57M in bf16, forward + backward, each backend (Triton chunk, Triton recurrent,
  PyTorch), against a same-width stock Llama (SDPA);
* decoding one token at contexts 256 .. 16k: ASM (Triton, PyTorch) vs the same-width Llama;
* ``loss``: a short bf16 training run (a small ASM, the same seed and batches) with the chunk and
  the recurrent kernels: the two loss curves and their largest gap.

Usage: python -m benchmarks.gpu.asm [--jsonl FILE] [--quick]
       [--sections layer,model,decode,loss,fla]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
from transformers import LlamaForCausalLM

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import median_seconds, timed
from hf_memory.models.transformers_compat import cache_kwargs, output_cache
from modeling.asm import ASMConfig, ASMForCausalLM, asa_attend_chunk_autograd
from modeling.asm.asm_fused_recurrent import asa_attend_fused_recurrent
from modeling.asm.asm_triton_chunk import asa_attend_triton_chunk
from modeling.asm.baseline_asm import matched_llama_config

CUDA = torch.device("cuda")


def timed_with_peak(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of ``fn`` (after one warm-up) and its peak memory in GiB."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return median_seconds(fn, repeats, device=CUDA), torch.cuda.max_memory_allocated() / 2**30


def naive_loop(logits, v, q, key_logits, gamma):
    """The exact per-token recurrence as a Python loop (one step = a handful of launches)."""
    b, h, t, k = logits.shape
    m = torch.full((b, h, k), float("-inf"), device=v.device)
    den = torch.zeros(b, h, k, device=v.device)
    num = torch.zeros(b, h, k, v.shape[-1], device=v.device)
    outs = []
    for i in range(t):
        lg = logits[:, :, i].float()
        c = torch.maximum(m, lg).detach()
        carry, e = torch.exp(m - c), torch.exp(lg - c)
        den = den * carry + e
        num = num * carry[..., None] + e[..., None] * v[:, :, i, None, :].float()
        m = c
        slot = num / den[..., None]
        content = (slot * q[:, :, i, None, :].float()).sum(-1)
        r = torch.softmax(key_logits[:, :, i].float() + gamma[:, None] * content, dim=-1)
        outs.append((r[..., None] * slot).sum(-2))
    return torch.stack(outs, dim=2)


def scan_inputs(b: int, t: int, h: int, k: int, d: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(0)
    logits = torch.randn(b, h, t, k, generator=gen, device=CUDA)
    logits = logits + 0.01 * torch.arange(t, device=CUDA)[:, None]  # a recency ramp
    v = torch.randn(b, h, t, d, generator=gen, device=CUDA)
    q = torch.randn(b, h, t, d, generator=gen, device=CUDA) / d ** 0.5
    key_logits = torch.randn(b, h, t, k, generator=gen, device=CUDA)
    gamma = torch.full((h,), 0.5, device=CUDA)
    return [x.bfloat16().requires_grad_() for x in (logits, v, q, key_logits)] + [gamma]


def scan_step(fn, inputs):
    def run():
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    return run


def gsa_step(b: int, t: int, h: int, k: int, d: int):
    """fla's chunk_gsa (no forget gate: plain ABC) on the same shapes, bf16, fwd + bwd."""
    from fla.ops.gsa import chunk_gsa
    gen = torch.Generator(device=CUDA).manual_seed(0)
    q, kk, v = (torch.randn(b, t, h, d, generator=gen, device=CUDA).bfloat16().requires_grad_()
                for _ in range(3))
    s = torch.randn(b, t, h, k, generator=gen, device=CUDA).bfloat16().requires_grad_()

    def run():
        out = chunk_gsa(q, kk, v, s)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    return run


def layer_table(args, config: ASMConfig, rows: list[dict]) -> None:
    h, k, d = config.num_attention_heads, config.num_slots, config.head_dim
    forms = {f"chunk{c}": (lambda *x, c=c: asa_attend_triton_chunk(*x, chunk=c))
             for c in (16, 32, 64)}
    forms["recurrent"] = asa_attend_fused_recurrent
    forms["torch"] = lambda *x: asa_attend_chunk_autograd(*x, chunk_size=config.chunk_size)
    print(f"# one ASM-57M layer (H={h} K={k} d={d}), scan + read fwd+bwd, bf16 inputs, tok/s")
    print(f"{'B':>3} {'T':>6} " + " ".join(f"{n:>10}" for n in forms)
          + f" {'loop':>8} {'best chunk/recurrent':>21} {'mem best chunk/recurrent':>25}")
    for b in args.batches:
        for t in args.lengths:
            inputs = scan_inputs(b, t, h, k, d)
            row = {"section": "layer", "B": b, "T": t}
            for name, fn in forms.items():
                sec, mem = timed_with_peak(scan_step(fn, inputs), args.repeats)
                row[name] = {"s": sec, "tok_s": b * t / sec, "peak_gib": mem}
            if t <= args.loop_max:
                sec, mem = timed_with_peak(scan_step(naive_loop, inputs), 1)
                row["loop"] = {"s": sec, "tok_s": b * t / sec, "peak_gib": mem}
            best = max((n for n in forms if n.startswith("chunk")),
                       key=lambda n: row[n]["tok_s"])
            row["best_chunk"] = best
            rows.append(row)
            loop = row.get("loop", {}).get("tok_s")
            print(f"{b:>3} {t:>6} " + " ".join(f"{row[n]['tok_s']:>10,.0f}" for n in forms)
                  + f" {loop or float('nan'):>8,.0f} {best:>8} "
                  f"{row[best]['tok_s'] / row['recurrent']['tok_s']:>11.2f}x "
                  f"{row[best]['peak_gib']:>14.2f}/{row['recurrent']['peak_gib']:.2f}",
                  flush=True)
            del inputs


def fla_table(args, config: ASMConfig, rows: list[dict]) -> None:
    """fla's chunk_gsa on the layer table's shapes (its first calls autotune: slow)."""
    h, k, d = config.num_attention_heads, config.num_slots, config.head_dim
    print(f"# fla chunk_gsa (H={h}, {k} slots, head dim {d}), fwd+bwd, bf16")
    for b in args.batches:
        for t in args.lengths:
            row = {"section": "fla_gsa", "B": b, "T": t}
            try:
                sec, mem = timed_with_peak(gsa_step(b, t, h, k, d), args.repeats)
                row.update(s=sec, tok_s=b * t / sec, peak_gib=mem)
                print(f"{b:>3} {t:>6} {row['tok_s']:>13,.0f} tok/s {mem:6.2f} GiB", flush=True)
            except Exception as exc:  # fla missing or refusing the shape: say why, go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"# fla chunk_gsa not measured: {row['error']}", flush=True)
                rows.append(row)
                return
            rows.append(row)


MODEL_BACKENDS = {"asm_chunk": "triton_chunk", "asm_recurrent": "triton", "asm_torch": "torch"}


def model_table(args, rows: list[dict]) -> None:
    names = [*MODEL_BACKENDS, "llama"]
    print("# whole model, bf16, forward + backward (loss), tokens/s")
    print(f"{'B':>3} {'T':>6} " + " ".join(f"{n:>13}" for n in names)
          + f" {'chunk/recurrent':>15} {'chunk/llama':>11}")
    for b, t in args.model_shapes:
        ids = torch.randint(0, 50257, (b, t), device=CUDA)
        row = {"section": "model", "B": b, "T": t}
        for name in names:
            model = build(name, t)
            model.train()

            def run(model=model, ids=ids):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                model.zero_grad(set_to_none=True)
            sec, mem = timed_with_peak(run, args.repeats)
            row[name] = {"s": sec, "tok_s": b * t / sec, "peak_gib": mem}
            del model
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"{b:>3} {t:>6} " + " ".join(f"{row[n]['tok_s']:>13,.0f}" for n in names)
              + f" {row['asm_chunk']['tok_s'] / row['asm_recurrent']['tok_s']:>14.2f}x"
              f" {row['asm_chunk']['tok_s'] / row['llama']['tok_s']:>10.2f}x", flush=True)


def build(name: str, context: int, **overrides):
    torch.manual_seed(0)
    config = ASMConfig(scan_backend=MODEL_BACKENDS.get(name, "triton"),
                       max_position_embeddings=max(1024, context + 64), **overrides)
    if name == "llama":
        llama = matched_llama_config(config)
        llama._attn_implementation = "sdpa"
        return LlamaForCausalLM(llama).to(CUDA, torch.bfloat16)
    return ASMForCausalLM(config).to(CUDA, torch.bfloat16)


def loss_curves(args, rows: list[dict]) -> None:
    """A small ASM trained ``args.loss_steps`` steps in bf16 from the same seed on the same
    batches (a fixed random Markov chain over 512 tokens, so there is something to learn) with
    the chunk and with the recurrent kernels."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    table = torch.randint(0, 512, (512, 4), generator=gen, device=CUDA)
    b, t = (4, 256) if args.quick else (8, 1024)

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator(device=CUDA).manual_seed(1000 + step)
        ids = [torch.randint(0, 512, (b,), generator=g, device=CUDA)]
        choice = torch.randint(0, 4, (b, t), generator=g, device=CUDA)
        for i in range(1, t):
            ids.append(table[ids[-1], choice[:, i]])
        return torch.stack(ids, dim=1)

    batches = [batch(step) for step in range(args.loss_steps)]
    curves = {}
    for name in ("asm_chunk", "asm_recurrent"):
        model = build(name, t, vocab_size=512, num_hidden_layers=4, hidden_size=256)
        model.train()
        optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []

        def train(model=model, optimiser=optimiser, curve=curve) -> None:
            for ids in batches:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimiser.step()
                optimiser.zero_grad(set_to_none=True)
                curve.append(loss.item())

        seconds = timed(train)[1]
        curves[name] = curve
        print(f"# {name}: loss {curve[0]:.3f} -> {curve[-1]:.3f} in {len(curve)} steps, "
              f"{seconds:.0f} s", flush=True)
        del model, optimiser
    gaps = [abs(a - c) for a, c in zip(curves["asm_chunk"], curves["asm_recurrent"], strict=True)]
    tail = curves["asm_recurrent"][-20:]
    print(f"# largest |chunk - recurrent| loss gap {max(gaps):.4f} (step {gaps.index(max(gaps))}); "
          f"last 20 steps: mean gap {statistics.mean(gaps[-20:]):.4f}, the recurrent curve's own "
          f"step-to-step spread {statistics.pstdev(tail):.4f}", flush=True)
    rows.append({"section": "loss", "B": b, "T": t, **curves})


def decode_table(args, rows: list[dict]) -> None:
    print(f"# decode, batch 1, bf16: ms per token (median of {args.decode_steps}) after a context")
    print(f"{'context':>7} {'asm triton':>11} {'asm torch':>10} {'llama':>8} {'triton/llama':>12}")
    models = {name: build(name, max(args.contexts)).eval()
              for name in ("asm_recurrent", "asm_torch", "llama")}
    for context in args.contexts:
        row = {"section": "decode", "context": context}
        ids = torch.randint(0, 50257, (1, context), device=CUDA)
        token = torch.randint(0, 50257, (1, 1), device=CUDA)
        with torch.inference_mode():
            for name, model in models.items():
                cache = output_cache(model(ids, use_cache=True))
                times = []
                for step in range(args.decode_steps + 2):
                    cache, seconds = timed(lambda m=model, c=cache, t=token: output_cache(
                        m(t, **cache_kwargs(c), use_cache=True)), CUDA)
                    if step >= 2:
                        times.append(seconds)
                row[name] = 1000 * statistics.median(times)
                del cache
        rows.append(row)
        print(f"{context:>7} {row['asm_recurrent']:>11.2f} {row['asm_torch']:>10.2f} "
              f"{row['llama']:>8.2f} {row['asm_recurrent'] / row['llama']:>11.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_jsonl_argument(parser, "gpu")
    parser.add_argument("--quick", action="store_true", help="a small grid, to check the script")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default="layer,model,decode",
                        help="comma-separated, of layer, model, decode, loss, fla")
    parser.add_argument("--loss-steps", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu.asm needs a CUDA device")
    args.lengths = [256, 1024] if args.quick else [1024, 4096, 16384]
    args.batches = [1, 2] if args.quick else [1, 16]
    args.loop_max = 256 if args.quick else 1024
    args.model_shapes = [(1, 256)] if args.quick else [(16, 1024), (4, 4096)]
    args.contexts = [64, 256] if args.quick else [256, 2048, 8192, 16384]
    args.decode_steps = 4 if args.quick else 32
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    try:
        sections = args.sections.split(",")
        if "layer" in sections:
            layer_table(args, ASMConfig(), rows)
        if "model" in sections:
            model_table(args, rows)
        if "decode" in sections:
            decode_table(args, rows)
        if "loss" in sections:
            loss_curves(args, rows)
        if "fla" in sections:
            fla_table(args, ASMConfig(), rows)
    finally:
        log = ResultLog(args.jsonl, "gpu.asm")
        for row in rows:
            log.write(**row)


if __name__ == "__main__":
    main()
