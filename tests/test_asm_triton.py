"""ASA Triton scan kernels, both forms (fused recurrent, chunk-parallel), against the float64
references (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from hf_memory.models.transformers_compat import cache_kwargs, output_cache  # noqa: E402
from modeling.asm import (  # noqa: E402
    ASMConfig,
    ASMForCausalLM,
    asa_attend,
    asa_attend_chunk_autograd,
    asa_attend_naive,
)
from modeling.asm.asm_fused_recurrent import (  # noqa: E402
    asa_attend_fused_recurrent,
    causal_linear_attention_fused_recurrent,
    slot_read_fused_recurrent,
    slot_scores_fused_recurrent,
)
from modeling.asm.asm_naive import causal_linear_attention_naive, slot_read_naive, slot_scores_naive  # noqa: E402
from modeling.asm.asm_ops import resolve_backend  # noqa: E402
from modeling.asm.asm_triton_chunk import (  # noqa: E402
    asa_attend_triton_chunk,
    causal_linear_attention_triton_chunk,
    slot_read_triton_chunk,
    slot_scores_triton_chunk,
)
from tests.test_asm_kernels import run as run_kernels  # noqa: E402
from tests.test_asm_kernels import steep_inputs  # noqa: E402
from tests.test_properties_asm import TOL32, assert_close  # noqa: E402
from tests.test_properties_asm import build as property_inputs  # noqa: E402
from tests.test_properties_asm import outputs_and_grads as property_outputs  # noqa: E402
from tests.test_properties_asm import scan_cases as property_cases  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
SHAPES = [(1, 1, 1, 1, 1), (2, 7, 2, 3, 5), (1, 12, 1, 16, 8), (2, 5, 3, 6, 3), (2, 37, 2, 3, 5)]


def _chunked(fn):
    """The chunk form at its smallest chunk (16), so the tests' lengths span several chunks."""
    return lambda *args, **kwargs: fn(*args, **kwargs, chunk=16)


FORMS = {  # form -> (read, scores, linear attention, scan + read)
    "recurrent": (slot_read_fused_recurrent, slot_scores_fused_recurrent,
                  causal_linear_attention_fused_recurrent, asa_attend_fused_recurrent),
    "chunk": tuple(_chunked(f) for f in (slot_read_triton_chunk, slot_scores_triton_chunk,
                                         causal_linear_attention_triton_chunk,
                                         asa_attend_triton_chunk)),
}


def shape_id(shape: tuple[int, ...]) -> str:
    b, t, h, k, d = shape
    return f"B{b}-T{t}-H{h}-K{k}-d{d}"


def scan_inputs(b: int, t: int, h: int, k: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(b, h, t, k) * 2
    if t > 2:
        logits[0, :, : t // 3] = float("-inf")  # left padding
        if b > 1:
            logits[1, :, t - t // 3:] = float("-inf")  # right padding
    return logits, torch.randn(b, h, t, d)


def outputs_and_grads(fn, inputs: list[torch.Tensor], dtype: torch.dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * proj).sum(), leaves)
    return out.detach().double(), [g.double() for g in grads]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", ["read", "scores"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.slow
def test_kernels_match_reference_outputs_and_every_gradient(shape, op, form):
    b, t, h, k, d = shape
    logits, v = scan_inputs(*shape)
    first = torch.randn(b, h, t, k) if op == "read" else torch.randn(b, h, t, d)
    read, scores = FORMS[form][:2]
    kernel, ref = (read, slot_read_naive) if op == "read" else (scores, slot_scores_naive)
    out, grads = outputs_and_grads(kernel, [first, logits, v], torch.float32)
    ref_out, ref_grads = outputs_and_grads(ref, [first, logits, v], torch.float64)
    torch.testing.assert_close(out, ref_out, **TOL)
    for a, e in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, **TOL)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("gated", [False, True], ids=["split", "gated"])
@pytest.mark.slow
def test_asa_attend_triton_matches_reference(gated, form):
    b, t, h, k, d = 2, 20, 2, 4, 3
    logits, v = scan_inputs(b, t, h, k, d)
    inputs = [logits, v, torch.randn(b, h, t, d) / 2, torch.randn(b, h, t, k), torch.rand(h) * 3,
              torch.randn(k, k), torch.tensor(0.7)]

    def run(fn, dtype, **kwargs):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        lg, vv, q, kl, gamma, w, gate = leaves
        o, r, delta = fn(lg, vv, q, kl, gamma, 0.8, lambda x: torch.tanh(x.to(dtype) @ w),
                         gate=gate if gated else None, **kwargs)[:3]
        outs = [o, r] + ([] if gated else [delta])
        gen = torch.Generator().manual_seed(4)
        loss = sum((x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64)).sum()
                   for x in outs)
        used = leaves if gated else leaves[:-1]
        return [x.detach().double() for x in outs] + [
            g.double() for g in torch.autograd.grad(loss, used)]

    for a, e in zip(run(FORMS[form][3], torch.float32), run(asa_attend_naive, torch.float64),
                    strict=True):
        torch.testing.assert_close(a, e, **TOL)


@pytest.mark.parametrize("form", FORMS)
def test_state_continuation_and_final_state_match_chunked(form):
    b, t, h, k, d = 1, 37, 2, 3, 4
    logits, v = scan_inputs(b, t, h, k, d)
    a = torch.randn(b, h, t, k)
    read = FORMS[form][0]
    full, final = read(a, logits, v)
    head, state = read(a[:, :, :20], logits[:, :, :20], v[:, :, :20])
    pieces = [head]
    for i in range(20, t, 5):  # pieces of 5, then the last 2
        piece, state = read(a[:, :, i:i + 5], logits[:, :, i:i + 5], v[:, :, i:i + 5], state)
        pieces.append(piece)
    torch.testing.assert_close(torch.cat(pieces, dim=2), full, **TOL)
    zeros = dict(q=torch.zeros(b, h, t, d), key_logits=torch.zeros(b, h, t, k), gamma=0.0)
    chunked_state = asa_attend_chunk_autograd(logits, v, **zeros, chunk_size=3)[3]
    for x, y in ((final.m, chunked_state.m), (final.den, chunked_state.den),
                 (final.num, chunked_state.num), (state.m, final.m), (state.den, final.den),
                 (state.num, final.num)):
        torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("b, t, h, m", [(1, 1, 1, 2), (2, 7, 2, 5), (1, 5, 1, 32),
                                        (2, 37, 1, 5)], ids=lambda x: str(x))
def test_linear_attention_kernels_match_reference(b, t, h, m, form):
    linear = FORMS[form][2]
    phi_q, phi_k, v = torch.rand(b, h, t, m) + 0.1, torch.rand(b, h, t, m) + 0.1, torch.randn(
        b, h, t, m)
    if t > 2:
        phi_k[0, :, :2] = 0.0  # left padding: nothing written, the first reads are zero
    out, grads = outputs_and_grads(linear, [phi_q, phi_k, v], torch.float32)
    ref_out, ref_grads = outputs_and_grads(causal_linear_attention_naive, [phi_q, phi_k, v],
                                           torch.float64)
    torch.testing.assert_close(out, ref_out, **TOL)
    for a, e in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, **TOL)
    _, state = linear(phi_q[:, :, : t // 2], phi_k[:, :, : t // 2], v[:, :, : t // 2])
    rest, (s, z) = linear(phi_q[:, :, t // 2:], phi_k[:, :, t // 2:], v[:, :, t // 2:], state)
    torch.testing.assert_close(rest.double(), ref_out[:, :, t // 2:], **TOL)
    torch.testing.assert_close(s, phi_k.transpose(-1, -2) @ v, **TOL)
    torch.testing.assert_close(z, phi_k.sum(2), **TOL)


def tiny_model(**overrides) -> ASMForCausalLM:
    torch.manual_seed(0)
    config = ASMConfig(vocab_size=31, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
                       num_slots=3, slot_space_dim=4, chunk_size=4, refinement_gate_init=0.0,
                       content_read_init=0.0, initializer_range=0.3, **overrides)
    return ASMForCausalLM(config).eval()


@pytest.mark.parametrize("backend", ["triton", "triton_chunk"])
@pytest.mark.slow
def test_model_forward_and_decode_on_triton_match_torch(backend):
    ids = torch.randint(1, 31, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    expected = tiny_model()(ids, attention_mask=mask).logits
    model = tiny_model(scan_backend=backend)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, **TOL)
    out = model(ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
    steps = [out.logits]
    for i in (4, 5):
        steps.append(model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1],
                           **cache_kwargs(output_cache(out)), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, **TOL)


def train_steps(model: ASMForCausalLM, steps: int = 3) -> tuple[list[float], dict]:
    """``steps`` SGD steps on one padded batch (left padding in row 0, right in row 1): the
    losses and the parameters after. (SGD, not Adam: Adam's first steps move every parameter
    by about the learning rate whatever its gradient's size, so a gradient of 1e-9 against
    -1e-9, equal to float32's precision, becomes a difference of 2 lr.)"""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 31, (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        loss = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["triton", "triton_chunk"])
@pytest.mark.slow
def test_training_steps_on_triton_equal_the_pytorch_path(backend):
    """Three training steps of a padded batch through the Triton kernels (the scan and the fused
    slot addressing, forward and backward) equal the PyTorch path's: every loss and every
    parameter after."""
    expected_losses, expected = train_steps(tiny_model())
    losses, params = train_steps(tiny_model(scan_backend=backend))
    torch.testing.assert_close(losses, expected_losses, **TOL)
    assert params.keys() == expected.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], **TOL, msg=name)


def test_dispatcher(monkeypatch):
    logits, v = scan_inputs(1, 4, 1, 2, 3)
    args = (logits, v, torch.randn(1, 1, 4, 3), torch.randn(1, 1, 4, 2), 0.5)
    assert torch.equal(asa_attend(*args, backend="auto")[0], asa_attend_chunk_autograd(*args)[0])
    assert torch.equal(asa_attend(*args, backend="triton")[0], asa_attend_fused_recurrent(*args)[0])
    assert torch.equal(asa_attend(*args, backend="triton_chunk")[0],
                       asa_attend_triton_chunk(*args)[0])
    with pytest.raises(ValueError, match="backend"):
        asa_attend(*args, backend="cuda")
    cuda = SimpleNamespace(is_cuda=True)  # what "auto" asks of the tensors
    assert [resolve_backend("auto", cuda, t) for t in (1, 31, 32, 4096)] == [
        "triton", "triton", "triton_chunk", "triton_chunk"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for backend in ("triton", "triton_chunk"):
        with pytest.raises(RuntimeError, match="triton"):
            asa_attend(*args, backend=backend)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case, op, t", [("rise2", "scores", 130), ("recency4", "read", 70),
                                         ("rise50", "read", 40)])
@pytest.mark.slow
def test_kernels_on_steep_logits_match_reference(case, op, t, form):
    """Issue 15, Triton side: write logits rising by 2 per token (to ~260) / the recency bias at
    strength 4; the recurrent kernels (running max rescaled at every token) give finite outputs
    and gradients equal to the float64 reference. (A backward that subtracted an absolute
    log-sum-exp lost ~ulp(260) in every weight: dv off by 2x the tolerance at T = 130.)"""
    x = steep_inputs(case, b=1, t=t, left=4)
    logits, v = x["logits"], x["v"]
    b, h, t, k = logits.shape
    first = torch.randn(b, h, t, k) if op == "read" else torch.randn(b, h, t, v.shape[-1])
    read, scores = FORMS[form][:2]
    kernel, ref = (read, slot_read_naive) if op == "read" else (scores, slot_scores_naive)
    out, grads = outputs_and_grads(kernel, [first, logits, v], torch.float32)
    ref_out, ref_grads = outputs_and_grads(ref, [first, logits, v], torch.float64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, **TOL)
    for a, e in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, **TOL)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case, gated", [("rise2", False), ("recency4", True)],
                         ids=["rise2-split", "recency4-gated"])
@pytest.mark.slow
def test_asa_attend_triton_equals_chunked_on_steep_logits(case, gated, form):
    """The Triton scan + read equals the PyTorch chunked path at chunk 64 on steep logits:
    outputs, read weights and the gradients of every input (rtol = atol = 1e-5)."""
    x = steep_inputs(case, b=1, t=70, left=4)  # chunk 0's running max rises by ~120
    weight = torch.randn(3, 3)
    out, grad = run_kernels(FORMS[form][3], x, weight, torch.float32, gated)
    chunked_out, chunked_grad = run_kernels(asa_attend_chunk_autograd, x, weight, torch.float32,
                                            gated,
                                            chunk_size=64)
    for a, e in zip(out + grad, chunked_out + chunked_grad, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, **TOL)


@pytest.mark.parametrize("backend", ["triton", "triton_chunk"])
@pytest.mark.slow
def test_model_with_recency_strength_4_on_triton_equals_torch(backend):
    """A model whose layers have recency strength 4 (2 per token in the first of 8 heads):
    the Triton prefill equals the PyTorch prefill at chunk 64, both finite."""
    ids = torch.randint(1, 31, (1, 70))
    config = dict(vocab_size=31, hidden_size=16, num_hidden_layers=1, num_attention_heads=8,
                  num_slots=3, slot_space_dim=4, chunk_size=64, recency_strength_init=4.0,
                  initializer_range=0.3)
    torch.manual_seed(0)
    expected = ASMForCausalLM(ASMConfig(**config)).eval()(ids).logits
    torch.manual_seed(0)
    model = ASMForCausalLM(ASMConfig(scan_backend=backend, **config)).eval()
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(model(ids).logits, expected, **TOL)


@settings(max_examples=12, deadline=None, derandomize=False, print_blob=True)
@given(case=property_cases(max_t=40), chunk=st.sampled_from([16, 32]))
@pytest.mark.slow
def test_chunk_kernels_match_float64_reference_property(case, chunk):
    """For any logit range (flat to +-30 per token per slot), offset and padding (the cases of
    ``tests/test_properties_asm.py``), the chunk-parallel Triton scan + read over several chunks
    gives finite outputs and input gradients equal to the float64 reference (float32
    tolerance, atol relative to magnitudes above 1)."""
    inputs = property_inputs(case)
    expected = property_outputs(asa_attend_naive, inputs, torch.float64)
    got = property_outputs(asa_attend_triton_chunk, inputs, torch.float32, chunk=chunk)
    for a, e in zip(got, expected, strict=True):
        assert torch.isfinite(a).all()
        assert_close(a, e, TOL32)
