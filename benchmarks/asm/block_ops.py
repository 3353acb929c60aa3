"""One ASA block's forward and backward by operation: which ops, how many launches, what traffic.

Every aten operation that reaches the dispatcher while one ``ASMBlock`` (pre-norm, ASA, MLP) of
the ASM-57M shape runs forward and backward on a random ``[B, T, D]`` batch is counted by name,
views and allocations left out: on a GPU each is a kernel launch (the scan's Triton kernels are
one each there; on the CPU the PyTorch chunk form runs instead, which the count shows). Beside
each op: its tensor traffic, the bytes of its tensor arguments plus its results (what a kernel
reads and writes if nothing stays in cache: an upper bound of the memory traffic), and the same
for one ``LlamaDecoderLayer`` of the same width as the yardstick. The block's own time per
forward + backward is printed too (median, one torch thread).

``--backend triton_chunk`` (or ``triton``) counts the GPU path: its Triton launches beside the
aten ops around them. On a CPU this needs ``TRITON_INTERPRET=1`` (set before the run; the
interpreter's own tensor copies inside a launch are not counted, and its times mean nothing).

Usage: python -m benchmarks.asm.block_ops [--batch 2] [--block 256] [--top 25]
    [--backend torch|triton|triton_chunk]
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from benchmarks.ops import NOT_KERNELS as BASE_NOT_KERNELS
from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import median_seconds
from modeling.asm import ASMConfig
from modeling.asm.baseline_asm import matched_llama_config
from modeling.asm.modeling_asm import ASMBlock

NOT_KERNELS = BASE_NOT_KERNELS | {  # and the other view-like ops a training block dispatches
    "empty_like", "split_with_sizes", "chunk", "_to_copy_view", "view_as", "expand_as",
    "movedim", "diagonal", "unflatten", "narrow", "real", "set_", "is_same_size", "zeros_like"}


def _bytes(values) -> int:
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += _bytes(value)
    return total


class OpTally(TorchDispatchMode):
    """Counts the aten operations dispatched inside it and their tensor traffic, by name, and
    the Triton launches (``launches``, by kernel) while :func:`counting_launches` is on."""

    active: OpTally | None = None

    def __init__(self):
        super().__init__()
        self.count: collections.Counter = collections.Counter()
        self.traffic: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()
        self.in_launch = False

    def __enter__(self):
        OpTally.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        OpTally.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in NOT_KERNELS and not self.in_launch:
            self.count[name] += 1
            self.traffic[name] += _bytes(args) + _bytes((kwargs or {}).values()) + _bytes(
                out if isinstance(out, (list, tuple)) else (out,))
        return out


@contextlib.contextmanager
def counting_launches():
    """Counts every Triton kernel launch into the active :class:`OpTally` (compiled kernels
    and the interpreter's alike), the interpreter's tensor copies inside a launch left out."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def counted(run):
        def launch(self, *args, **kwargs):
            tally = OpTally.active
            if tally is None:
                return run(self, *args, **kwargs)
            tally.launches[getattr(self, "__name__", None) or self.fn.__name__] += 1
            tally.in_launch = True
            try:
                return run(self, *args, **kwargs)
            finally:
                tally.in_launch = False
        return launch

    for cls, run in originals.items():
        cls.run = counted(run)
    try:
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run


def asm_block(config: ASMConfig, batch: int, block: int, device: str = "cpu"):
    layer = ASMBlock(config, 0).train()
    for module in layer.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    layer.to(device)
    positions = torch.arange(block, device=device).expand(batch, block)
    valid = torch.ones(batch, block, dtype=torch.bool, device=device)

    def run(x):
        return layer(x, positions, valid, None, False)[0]
    return run


def llama_layer(config: ASMConfig, batch: int, block: int, device: str = "cpu"):
    llama: LlamaConfig = matched_llama_config(config)
    llama._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(llama, 0).train().to(device)
    positions = torch.arange(block, device=device).expand(batch, block)
    rotary = LlamaRotaryEmbedding(llama).to(device)
    x0 = torch.zeros(batch, block, config.hidden_size, device=device)
    embeddings = rotary(x0, positions)

    def run(x):
        out = layer(x, attention_mask=None, position_ids=positions,
                    position_embeddings=embeddings)
        return out[0] if isinstance(out, tuple) else out
    return run


def forward_backward(run, x: torch.Tensor) -> None:
    run(x).square().mean().backward()


def tally(run, x) -> tuple[OpTally, OpTally]:
    forward_backward(run, x)  # warm caches and lazy state
    with OpTally() as fwd:
        y = run(x)
    loss = y.square().mean()
    with OpTally() as bwd:
        loss.backward()
    return fwd, bwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--top", type=int, default=25, help="ops listed per pass")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backend", choices=("torch", "triton", "triton_chunk"),
                        default="torch", help="the ASM scan backend counted (default: torch)")
    add_jsonl_argument(parser, "asm")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = ASMConfig(scan_backend=args.backend)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log = ResultLog(args.jsonl, "asm.block_ops", batch=args.batch, block=args.block,
                    hidden=config.hidden_size, heads=config.num_attention_heads,
                    backend=args.backend)
    print(f"# one block fwd + bwd, ASM-57M shape (d {config.hidden_size}, "
          f"{config.num_attention_heads} heads, K {config.num_slots}, M "
          f"{config.slot_space_dim}), batch {args.batch} x {args.block}, float32, 1 thread")
    for name, build in (("asm", asm_block), ("llama", llama_layer)):
        run = build(config, args.batch, args.block, device)
        x = torch.randn(args.batch, args.block, config.hidden_size, device=device,
                        requires_grad=True)
        with contextlib.nullcontext() if args.backend == "torch" else counting_launches():
            fwd, bwd = tally(run, x)
        ms = median_seconds(lambda run=run, x=x: forward_backward(run, x), args.repeats,
                            device=device) * 1e3
        total_ops = sum(fwd.count.values()) + sum(bwd.count.values())
        total_mib = (sum(fwd.traffic.values()) + sum(bwd.traffic.values())) / 2 ** 20
        print(f"\n{name}: forward {sum(fwd.count.values())} ops "
              f"({sum(fwd.traffic.values()) / 2 ** 20:.1f} MiB), backward "
              f"{sum(bwd.count.values())} ops ({sum(bwd.traffic.values()) / 2 ** 20:.1f} MiB); "
              f"fwd + bwd {ms:.1f} ms")
        if fwd.launches or bwd.launches:
            print(f"  Triton launches: forward {sum(fwd.launches.values())} "
                  f"{dict(fwd.launches)}, backward {sum(bwd.launches.values())} "
                  f"{dict(bwd.launches)}")
        log.write(model=name, forward_ops=sum(fwd.count.values()),
                  backward_ops=sum(bwd.count.values()), ops=total_ops, traffic_mib=total_mib,
                  fwd_bwd_ms=ms, forward=dict(fwd.count), backward=dict(bwd.count),
                  forward_launches=dict(fwd.launches), backward_launches=dict(bwd.launches))
        for label, t in (("forward", fwd), ("backward", bwd)):
            rows = t.traffic.most_common(args.top)
            print(f"  {label}: " + ", ".join(
                f"{op} x{t.count[op]} {mib / 2 ** 20:.1f}" for op, mib in rows))


if __name__ == "__main__":
    main()
