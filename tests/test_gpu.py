"""On a CUDA device: the Triton kernels compiled for real, ASM and memory inception in bf16.

Skipped cleanly where no GPU is visible (the ``gpu`` marker, tests/conftest.py). Tolerances,
fixed before the first GPU run:

* float32 kernels against float64 references, as relative norms ``|out - ref| / |ref|``: the
  scans carry a running state through T sequential rescaled updates, each rounding by a few
  float32 ulps, so the error grows like a random walk, ``~ sqrt(T) eps``; the bound is
  ``2e-6 * sqrt(T)`` (about 32 ulps times sqrt(T); 2.6e-4 at T = 16384), floored at 1e-5.
* bf16 *inputs* are rounded before the reference sees them and the kernels compute in float32,
  so the same bound holds for the (float32) outputs; their gradients come back in bf16, rounded
  once more (relative error at most 2^-9 per element), so 2^-9 is added for those.
* whole bf16 models (weights and activations in bf16) against the same weights in float64:
  relative norm of the logits below 2e-2 (bf16 operands give 1e-3 to 1e-2 per product chain;
  a few layers compound it), and the Triton path no worse than 1.5x the PyTorch path in the
  same precision.
* float64 on the GPU: the memory-inception mixture equals the concatenated-softmax reference
  at 1e-10, as on the CPU (float64 takes the reference path: the CUDA kernels that return a
  log-sum-exp take no float64).
* the stock attention with its log-sum-exp (flash / memory-efficient kernels) against float64
  on the same (rounded) inputs: float32 within ``bound(S)``; bf16 outputs within 2^-6 absolute
  (the kernels round the softmax weights to bf16 before the value product and the output once
  more, 2^-9 relative each, times values up to ~4.5 in size) and log-sum-exps within 1e-3
  (exact bf16 products summed in float32). The model-level fast path against the reference
  path: float32 logits within 1e-4, bf16 within the 2e-2 relative norm above.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")

from hf_memory import BankSet, steer  # noqa: E402
from hf_memory.models.transformers_compat import cache_kwargs, output_cache  # noqa: E402
from hf_memory.steering.stock_attention import attention_with_lse  # noqa: E402
from modeling.asm import ASMConfig, ASMForCausalLM, asa_attend_chunk_autograd  # noqa: E402
from modeling.asm.asm_fused_recurrent import (  # noqa: E402
    asa_attend_fused_recurrent,
    causal_linear_attention_fused_recurrent,
    slot_read_fused_recurrent,
    slot_scores_fused_recurrent,
)
from modeling.asm.asm_naive import causal_linear_attention_naive  # noqa: E402
from modeling.asm.asm_triton_chunk import (  # noqa: E402
    asa_attend_triton_chunk,
    causal_linear_attention_triton_chunk,
    slot_read_triton_chunk,
    slot_scores_triton_chunk,
)
from tests.test_memory_inception import (  # noqa: E402
    ConcatReference,
    manual_greedy,
    random_bank,
    token_ids,
)
from tests.test_steering_lse_path import (  # noqa: E402
    SDPA_FAMILIES,
    contrastive,
    padded_batch,
    softmax_reference,
)
from tests.tiny_models import FAMILIES, tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
LENGTHS = [1, 7, 1024, 4096, 16384]
HEADS, SLOTS, WIDTH = 8, 16, 48  # one ASM-57M layer
FORMS = {  # Triton form -> (read, scores, linear attention, scan + read)
    "recurrent": (slot_read_fused_recurrent, slot_scores_fused_recurrent,
                  causal_linear_attention_fused_recurrent, asa_attend_fused_recurrent),
    "chunk": (slot_read_triton_chunk, slot_scores_triton_chunk,
              causal_linear_attention_triton_chunk, asa_attend_triton_chunk),
}


def bound(t: int) -> float:
    return max(1e-5, 2e-6 * math.sqrt(t))


def relative(a: torch.Tensor, ref: torch.Tensor, scale: float = 1e-300) -> float:
    """``|a - ref| / max(|ref|, scale)``; ``scale`` for a reference that may vanish."""
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a.detach().double() - ref).norm() / max(float(ref.norm()), scale))


def padded_logits(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """Write logits ``[B, H, T, K]``: row 0 left-padded, row 1 right-padded (-inf)."""
    logits = torch.randn(b, HEADS, t, SLOTS, generator=gen, device=CUDA) * 2
    if t > 2:
        logits[0, :, : t // 8 + 1] = float("-inf")
        logits[1, :, t - t // 8 - 1:] = float("-inf")
    return logits


def slot_states64(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 slot states ``[B, H, T, K, d]`` by cumulative sums (no recurrence): each slot is
    the softmax-over-time average of the values written so far (0 before the first write)."""
    lg, v = logits.double(), v.double()
    top = lg.amax(dim=2, keepdim=True).clamp_min(-1e300)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(lg - top)  # [B, H, T, K]; randn logits: no underflow in float64
    num = torch.cumsum(e[..., None] * v[:, :, :, None, :], dim=2)
    den = torch.cumsum(e, dim=2)[..., None]
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def scan_case(op: str, t: int, dtype: torch.dtype):
    gen = torch.Generator(device=CUDA).manual_seed(t)
    b = 2
    logits = padded_logits(b, t, gen)
    v = torch.randn(b, HEADS, t, WIDTH, generator=gen, device=CUDA)
    first = torch.randn(b, HEADS, t, SLOTS if op == "read" else WIDTH, generator=gen, device=CUDA)
    inputs = [x.to(dtype) for x in (first, logits, v)]
    proj = torch.randn(b, HEADS, t, WIDTH if op == "read" else SLOTS, generator=gen,
                       device=CUDA, dtype=torch.float64)
    return inputs, proj


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("op", ["read", "scores"])
def test_compiled_scan_kernels_match_float64(op, t, dtype, form):
    inputs, proj = scan_case(op, t, dtype)
    kernel = FORMS[form][0] if op == "read" else FORMS[form][1]
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = kernel(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.float32
    grads = torch.autograd.grad((out.double() * proj).sum(), leaves)

    exact = [x.detach().double().requires_grad_() for x in inputs]
    states = slot_states64(exact[1], exact[2])
    pattern = "bhtk,bhtkd->bhtd" if op == "read" else "bhtd,bhtkd->bhtk"
    ref = torch.einsum(pattern, exact[0], states)
    ref_grads = torch.autograd.grad((ref * proj).sum(), exact)
    finite = torch.isfinite(exact[1].detach())
    assert relative(out, ref.detach()) <= bound(t)
    for name, g, e in zip(("first", "logits", "v"), grads, ref_grads, strict=True):
        scale = 1e-300
        if name == "logits":  # padded (-inf) logits get a zero gradient in both
            assert (g[~finite] == 0).all()
            g, e = g[finite], e[finite]
            # it vanishes exactly at T = 1 (one write, weight 1): measured on dv's scale
            scale = float(ref_grads[2].norm())
        rounding = 2.0 ** -9 if dtype == torch.bfloat16 else 0.0  # the gradient's own dtype
        assert relative(g, e, scale) <= bound(t) + rounding, name


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("t", [1, 7, 1024, 4096])
def test_compiled_linear_attention_matches_float64(t, form):
    gen = torch.Generator(device=CUDA).manual_seed(t)
    shape = (2, HEADS, t, 32)  # the ASM-57M slot space
    phi_q = torch.rand(shape, generator=gen, device=CUDA) + 0.1
    phi_k = torch.rand(shape, generator=gen, device=CUDA) + 0.1
    v = torch.randn(shape, generator=gen, device=CUDA)
    if t > 2:
        phi_k[0, :, : t // 8 + 1] = 0.0  # left padding writes nothing
    leaves = [x.requires_grad_() for x in (phi_q, phi_k, v)]
    out, _ = FORMS[form][2](*leaves)
    proj = torch.randn(shape, generator=gen, device=CUDA, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * proj).sum(), leaves)
    exact = [x.detach().double().requires_grad_() for x in leaves]
    ref = causal_linear_attention_naive(*exact)
    ref_grads = torch.autograd.grad((ref * proj).sum(), exact)
    assert relative(out, ref.detach()) <= bound(t)
    # at T = 1, out = v whatever q and k: dq and dk vanish exactly, so measured on dv's scale
    scale = float(ref_grads[2].norm())
    for g, e in zip(grads, ref_grads, strict=True):
        assert relative(g, e, scale) <= bound(t)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("t", [7, 4096])
def test_compiled_asa_attend_on_steep_logits_matches_float64(t, form):
    """Scan + content read with a recency ramp (+0.05 per token, to ~200 at T = 4096): the
    compiled kernels against the float64 chunked path, outputs and every gradient."""
    gen = torch.Generator(device=CUDA).manual_seed(3)
    b = 2
    logits = padded_logits(b, t, gen) + 0.05 * torch.arange(t, device=CUDA)[:, None]
    v = torch.randn(b, HEADS, t, WIDTH, generator=gen, device=CUDA)
    q = torch.randn(b, HEADS, t, WIDTH, generator=gen, device=CUDA) / WIDTH ** 0.5
    key_logits = torch.randn(b, HEADS, t, SLOTS, generator=gen, device=CUDA)
    gamma = torch.rand(HEADS, generator=gen, device=CUDA) + 0.5
    inputs = [logits, v, q, key_logits, gamma]

    def run(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        o, r = fn(*leaves)[:2]
        g = torch.Generator(device=CUDA).manual_seed(5)
        loss = sum((x.double() * torch.randn(x.shape, generator=g, device=CUDA,
                                             dtype=torch.float64)).sum() for x in (o, r))
        grads = torch.autograd.grad(loss, leaves)
        return [o.detach(), r.detach()] + list(grads)

    got, ref = run(FORMS[form][3], torch.float32), run(asa_attend_chunk_autograd, torch.float64)
    finite = torch.isfinite(logits)
    for i, (a, e) in enumerate(zip(got, ref, strict=True)):
        if i == 2:
            a, e = a[finite], e[finite]
        assert relative(a, e) <= bound(t), i


def asm(dtype: torch.dtype, backend: str, layers: int = 2) -> ASMForCausalLM:
    torch.manual_seed(0)
    config = ASMConfig(vocab_size=512, hidden_size=384, num_hidden_layers=layers,
                       num_attention_heads=HEADS, scan_backend=backend,
                       refinement_gate_init=0.5, content_read_init=0.5)
    return ASMForCausalLM(config).to(CUDA, dtype).eval()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_decode_on_cuda_equals_the_full_pass(backend):
    """``auto`` (on CUDA: the Triton chunk kernels for the prefill, the recurrent ones for each
    token) and ``torch`` (the gated one-token step) both equal the float64 full pass."""
    ids = torch.randint(1, 512, (2, 300), device=CUDA)
    mask = torch.ones_like(ids)
    mask[0, :37] = 0
    with torch.no_grad():
        full = asm(torch.float32, backend)(ids, attention_mask=mask).logits
        ref = asm(torch.float64, "torch")(ids, attention_mask=mask).logits
        assert relative(full, ref) <= bound(300)
        model = asm(torch.float32, backend)
        out = model(ids[:, :290], attention_mask=mask[:, :290], use_cache=True)
        steps = [out.logits]
        cache = output_cache(out)
        for i in range(290, 300):
            out = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], **cache_kwargs(cache),
                        use_cache=True)
            cache = output_cache(out)
            steps.append(out.logits)
    assert relative(torch.cat(steps, dim=1), ref) <= bound(300)


@pytest.mark.parametrize("backend", ["triton", "triton_chunk"])
def test_bf16_asm_triton_is_as_accurate_as_the_pytorch_path(backend):
    ids = torch.randint(1, 512, (2, 1024), device=CUDA)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    with torch.no_grad():
        ref = asm(torch.float64, "torch")(ids, attention_mask=mask).logits
        triton = asm(torch.bfloat16, backend)(ids, attention_mask=mask).logits
        chunked = asm(torch.bfloat16, "torch")(ids, attention_mask=mask).logits
    err_triton, err_torch = relative(triton, ref), relative(chunked, ref)
    assert err_triton <= 2e-2
    assert err_triton <= 1.5 * err_torch + 1e-4


@pytest.mark.parametrize("backend", ["triton", "triton_chunk"])
def test_bf16_asm_trains_on_triton(backend):
    model = asm(torch.bfloat16, backend).train()
    ids = torch.randint(1, 512, (2, 512), device=CUDA)
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert math.isfinite(float(loss))


# -- memory inception on the GPU


def on_cuda(bank):
    return bank.__class__.from_tensors(bank.keys.to(CUDA), bank.values.to(CUDA), name=bank.name,
                                       role=bank.role, layers=bank.layers, gain=bank.gain)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_mixture_on_cuda_equals_the_concatenated_softmax(family):
    model = tiny_model(family).to(CUDA)
    banks = [on_cuda(random_bank("t", "target", 5, gain=1.5, seed=1)),
             on_cuda(random_bank("r", "reference", 3, gain=0.7, seed=2))]
    sites = {1: [0, 3], 2: [1, 2, 3]}
    ids = token_ids().to(CUDA)
    with torch.no_grad():
        with steer(model, BankSet(banks, gamma=1.3), units=sites, layer_gains={1: 0.8, 2: 0.8}):
            steered = model(ids).logits
        with ConcatReference(model, banks, sites, rho=0.8, gamma=1.3):
            expected = model(ids).logits
    torch.testing.assert_close(steered, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_steered_generation_on_cuda(family):
    """bf16 weights, banks in bf16 (the mixture computes in float32): logits within bf16
    tolerance of the float64 model under the same banks; greedy generate() equals a manual
    decode loop on the same cache; an empty bank set changes nothing, bit for bit."""
    banks64 = [on_cuda(random_bank("t", "target", 5, gain=2.0)),
               on_cuda(random_bank("r", "reference", 3))]
    ids = token_ids(2, 40).to(CUDA)
    with torch.no_grad():
        exact = tiny_model(family).to(CUDA)
        with steer(exact, banks64):
            ref = exact(ids).logits
        model = tiny_model(family, dtype=torch.bfloat16).to(CUDA)
        banks = [b.__class__.from_tensors(b.keys.bfloat16(), b.values.bfloat16(), name=b.name,
                                          role=b.role, layers=b.layers, gain=b.gain)
                 for b in banks64]
        plain = model(ids).logits
        with steer(model, []):
            assert torch.equal(model(ids).logits, plain)
        with steer(model, banks):
            steered = model(ids).logits
            generated = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False,
                                       pad_token_id=0)
            expected = manual_greedy(model, ids[:1, :8], 8)
    assert relative(steered, ref) <= 2e-2
    assert torch.equal(generated, expected)


LSE_LAYOUTS = {  # name -> batch, KV heads, group, query length, history length, mask, head subset
    "decode": (2, 2, 3, 1, 37, "none", False),
    "decode-padded": (3, 2, 3, 1, 37, "shared", False),
    "decode-heads": (2, 2, 3, 1, 130, "per_head", True),
    "prefill-causal": (2, 2, 2, 45, 45, "none", False),
    "prefill-padded": (3, 1, 4, 9, 21, "empty_row", False),
    "decode-long": (4, 8, 4, 1, 2048, "shared", False),
    "chunk-long": (1, 8, 4, 64, 2048, "shared", False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(LSE_LAYOUTS))
def test_attention_with_lse_on_cuda_matches_float64(layout, dtype):
    batch, kv_heads, group, q_len, span, mask, subset = LSE_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(len(layout))
    heads = kv_heads * group
    query, key, value = (torch.randn(batch, n, length, 64, generator=gen).to(dtype)
                         for n, length in ((heads, q_len), (kv_heads, span), (kv_heads, span)))
    kv_index = torch.arange(heads) // group
    chosen = torch.tensor([heads - 1, 0]) if subset else None
    if chosen is not None:
        query, kv_index = query[:, chosen], kv_index[chosen]
    visible = None
    if mask != "none":
        per = query.shape[1] if mask == "per_head" else 1
        visible = torch.rand(batch, per, q_len, span, generator=gen) < 0.7
        visible[..., -1] = True
        if mask == "empty_row":
            visible[0, :, 0] = False
    out, lse = attention_with_lse(
        query.to(CUDA), key.to(CUDA), value.to(CUDA),
        None if visible is None else visible.to(CUDA), scaling=0.125,
        kv_index=None if chosen is None else kv_index.to(CUDA))
    want, want_lse = softmax_reference(
        query, key, value,
        visible if visible is not None or q_len == 1 else
        torch.ones(q_len, span, dtype=torch.bool).tril()[None, None], 0.125, kv_index)
    assert out.dtype == dtype and lse.dtype == torch.float32
    if dtype == torch.float32:
        tol = dict(rtol=bound(span), atol=bound(span))
        lse_tol = tol
    else:
        tol, lse_tol = dict(rtol=2**-8, atol=2**-6), dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out.cpu().double(), want, **tol)
    torch.testing.assert_close(lse.cpu().double(), want_lse, **lse_tol)


def moved(banks, dtype):
    def one(bank):
        return dataclasses.replace(
            bank, keys=bank.keys.to(CUDA, dtype), values=bank.values.to(CUDA, dtype),
            positions=None if bank.positions is None else bank.positions.to(CUDA))
    return BankSet([one(b) for b in banks.banks], gamma=banks.gamma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_lse_path_on_cuda_equals_the_reference_path(family, dtype, lse_calls, monkeypatch):
    """The banks merged into the CUDA kernel's output by its log-sum-exp — in one Triton kernel
    (the default path) and in PyTorch ops (``torch``) — against the history recomputed beside
    it: left padding, head-subset sites, positioned and contrastive banks, then cached greedy
    decoding."""
    from hf_memory.steering import fused_merge

    fused_calls = []
    real = fused_merge.fused_bank_mixture_by_lse

    def counted(*args, **kwargs):
        fused_calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_merge, "fused_bank_mixture_by_lse", counted)
    model = tiny_model(family, dtype=dtype).to(CUDA)
    banks = moved(contrastive(positioned=True), dtype)
    ids, mask = (x.to(CUDA) for x in padded_batch())
    logits, tokens = {}, {}
    with torch.no_grad():
        for path in ("auto", "torch", "reference"):
            with steer(model, banks, mixture_path=path, units={1: [0, 3], 2: [1, 2, 3]},
                       layer_gains={1: 0.8, 2: 1.2}):
                logits[path] = model(ids, attention_mask=mask).logits.double()
                tokens[path] = model.generate(ids, attention_mask=mask, max_new_tokens=6,
                                              do_sample=False, pad_token_id=0)
    assert lse_calls, "the log-sum-exp path did not run"
    assert any(shape[2] == 1 for shape in fused_calls), "no decoding step ran the fused merge"
    for path in ("auto", "torch"):
        if dtype == torch.float32:
            torch.testing.assert_close(logits[path], logits["reference"], rtol=1e-4, atol=1e-4)
            assert torch.equal(tokens[path], tokens["reference"])
        else:
            assert relative(logits[path], logits["reference"]) <= 2e-2
