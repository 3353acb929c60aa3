"""Which CUDA kernel gives a steered layer the history's attention *and* its log-sum-exp.

The steering merges its banks into the stock attention's output through the history's
log-sum-exp (``hf_memory.steering.stock_attention``). Candidates, each timed against the stock
call (``F.scaled_dot_product_attention``, which returns no log-sum-exp) at Llama-3.2-1B's
attention shape (32 query heads, 8 KV heads, head dim 64), bf16, history 2,048:

* ``shipped``: ``attention_with_lse`` as the steering calls it (its module docstring);
* ``efficient``: the memory-efficient kernel everywhere (given the mask even where none is needed);
* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` with ``compute_log_sumexp``, KV heads
  repeated (as transformers' SDPA path does with a mask); ``cudnn-packed``: decoding only, a KV
  group's query heads as the rows of one query (no repeat);
* ``flex``: ``flex_attention(..., return_lse=True)`` compiled (two shapes: it compiles per shape).

Each row also gives the largest output difference from the stock call and the largest
log-sum-exp difference from a float32 ``logsumexp`` of the scores (over the query rows that see
a key).

Usage: python -m benchmarks.gpu.lse_kernels [--jsonl FILE] [--no-flex]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import median_cuda_ms
from hf_memory.steering import stock_attention
from hf_memory.steering.stock_attention import attention_with_lse

CUDA = torch.device("cuda")
HEADS, KV_HEADS, DIM, SCALE = 32, 8, 64, 0.125
SHAPES = [  # name, batch, query length, history length, padded
    ("decode", 1, 1, 2048, False),
    ("decode", 8, 1, 2048, True),
    ("decode", 32, 1, 2048, True),
    ("prefill", 1, 2048, 2048, False),
    ("prefill", 8, 512, 512, True),
]
FLEX_SHAPES = {("decode", 8), ("prefill", 1)}


def inputs(batch: int, q_len: int, span: int, padded: bool):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    q = torch.randn(batch, HEADS, q_len, DIM, device=CUDA, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, KV_HEADS, span, DIM, device=CUDA, generator=gen,
                        dtype=torch.bfloat16) for _ in range(2))
    visible = None
    if padded:  # left padding: row r starts at 16 r (every row keeps most of its history)
        starts = (torch.arange(batch, device=CUDA) * 16)[:, None]
        columns = torch.arange(span, device=CUDA)
        visible = (columns >= starts)[:, None, None, :].expand(batch, 1, q_len, span)
        if q_len > 1:
            visible = visible & torch.ones(q_len, span, dtype=torch.bool, device=CUDA).tril(
                span - q_len)
    return q, k, v, visible  # (no mask and T > 1: causal)


def candidates(q, k, v, visible, causal: bool, flex: bool):
    group = HEADS // KV_HEADS
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    bias = None if visible is None else torch.zeros(
        visible.shape, dtype=q.dtype, device=CUDA).masked_fill(~visible, float("-inf"))
    full_bias = None if bias is None else bias.expand(q.shape[0], HEADS, q.shape[2], k.shape[2])

    def stock():  # as transformers' SDPA path calls it: GQA in the kernel only without a mask
        if visible is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE,
                                                  enable_gqa=True), None
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=visible, scale=SCALE), None

    def shipped():
        return attention_with_lse(q, k, v, visible, scaling=SCALE)

    everything = visible if visible is not None else torch.ones(
        q.shape[2], k.shape[2], dtype=torch.bool, device=CUDA).tril(k.shape[2] - q.shape[2])[
            None, None]
    everything_bias = stock_attention._additive(~everything, q.dtype)

    def efficient():
        return stock_attention._by_groups(stock_attention._efficient)(q, k, v, everything_bias,
                                                                      False, SCALE)

    def cudnn():
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, kr, vr, full_bias, True, 0.0, causal, False, scale=SCALE)
        return out[0], out[1].reshape(q.shape[0], HEADS, q.shape[2])

    def cudnn_packed():
        return stock_attention._by_groups(stock_attention._cudnn)(q, k, v, bias, False, SCALE)

    found = {"stock": stock, "shipped": shipped, "efficient": efficient, "cudnn": cudnn}
    if q.shape[2] == 1 and bias is not None:
        found["cudnn-packed"] = cudnn_packed
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        block = None
        if visible is not None or causal:
            def mask_mod(b, h, i, j):
                return visible[b, 0, i, j] if visible is not None else j <= i

            block = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2],
                                      device=CUDA)

        def flex_lse():
            return compiled(q, k, v, block_mask=block, scale=SCALE, enable_gqa=True,
                            return_lse=True)

        found["flex"] = flex_lse
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_jsonl_argument(parser, "gpu")
    parser.add_argument("--no-flex", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu.lse_kernels needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, H {HEADS}, "
          f"KVH {KV_HEADS}, D {DIM}; ms (ratio stock / candidate), max |out - stock|, "
          f"max |lse - float32 lse|", flush=True)
    log = ResultLog(args.jsonl, "gpu.lse_kernels")
    for kind, batch, q_len, span, padded in SHAPES:
        q, k, v, visible = inputs(batch, q_len, span, padded)
        causal = visible is None and q_len > 1
        scores = (q.float() @ k.float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(-1, -2)
                  * SCALE)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        elif causal:
            scores = scores.masked_fill(~torch.ones(q_len, span, dtype=torch.bool,
                                                    device=CUDA).tril(), float("-inf"))
        want_lse = torch.logsumexp(scores, -1)
        del scores
        flex = not args.no_flex and (kind, batch) in FLEX_SHAPES
        found = candidates(q, k, v, visible, causal, flex)
        reference, _ = found["stock"]()
        base = median_cuda_ms(found["stock"])
        cells = []
        for name, fn in found.items():
            row = {"shape": kind, "batch": batch, "q_len": q_len, "history": span,
                   "padded": padded, "kernel": name}
            try:
                out, lse = fn()
                row["ms"] = median_cuda_ms(fn)
                row["ratio"] = base / row["ms"]
                seen = torch.isfinite(want_lse)  # (rows that see no key are left out)
                row["out_err"] = float((out.float() - reference.float()).abs().amax(-1)[seen]
                                       .max())
                if lse is not None:
                    row["lse_err"] = float((lse.float() - want_lse)[seen].abs().max())
                cells.append(f"{name} {row['ms']:.3f} ({row['ratio']:.2f}x, "
                             f"{row['out_err']:.1e}, {row.get('lse_err', 0):.1e})")
            except Exception as error:  # a kernel that refuses the shape: say so, go on
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                cells.append(f"{name} n/a ({row['error'][:60]})")
            log.write(**row)
        print(f"{kind} B {batch} T {q_len} S {span}{' padded' if padded else ''}: "
              + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
