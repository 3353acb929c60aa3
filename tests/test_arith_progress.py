"""Progress measures and the Fourier check on hand-built weights with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from modeling.arith import (
    ArithConfig,
    ArithTask,
    ArithTransformer,
    fourier_analysis,
    ov2_mlp2_logits,
    progress_measures,
    qk_scores,
    sample_batch,
)

TASK = ArithTask()
T = TASK.seq_len
V = TASK.vocab_size


def probe_batch(task: ArithTask = TASK, size: int = 512) -> dict[str, torch.Tensor]:
    return sample_batch(task, size, torch.Generator().manual_seed(7))


def zero_model(**sizes) -> ArithTransformer:
    model = ArithTransformer(ArithConfig(**sizes))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_uniform_attention_gives_the_counting_values():
    """Zero Q/K weights: every query attends uniformly to its prefix."""
    model = ArithTransformer(ArithConfig(hidden_size=32, head_dim=16, intermediate_size=16))
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.zero_()
    batch = probe_batch()
    out = progress_measures(model, TASK, batch)
    assert math.isclose(out["attn_l1_equal_to_operands"], 2 / T, rel_tol=1e-5)
    assert math.isclose(out["attn_l2_equal_to_values"], 2 / T, rel_tol=1e-5)
    ids = batch["input_ids"][:, :TASK.prefix_len]
    rows, cols = (ids < TASK.modulus).nonzero(as_tuple=True)
    expected = (1.0 / (cols + 1).double()).mean().item()
    assert math.isclose(out["attn_l1_num_to_prev"], expected, rel_tol=1e-5)
    assert all(math.isfinite(v) for v in out.values())


def ideal_binding_model(beta: float = 300.0) -> ArithTransformer:
    """Layer 0: a previous-token head on positions, "=" attends to the operand slots, OV copies
    the token identity; layer 1: QK is the identity on token dimensions.

    Residual basis: dims ``[0, T)`` one-hot positions, dims ``[T, T + V)`` one-hot tokens.
    """
    d = T + V
    model = zero_model(hidden_size=d, head_dim=d, intermediate_size=8)
    eye = torch.eye(d)
    p = TASK.prefix_len
    with torch.no_grad():
        model.embed_positions.weight.copy_(eye[:T])
        model.embed_tokens.weight.copy_(eye[T:])
        a0, a1 = model.layers[0].self_attn, model.layers[1].self_attn
        q = torch.zeros(d, d)
        for i in range(1, p):
            q[i - 1, i] = beta  # query at position i looks for the key at i - 1
        q[p + 1, T - 1] = q[p + 2, T - 1] = beta  # "=" looks at the operand slots
        a0.q_proj.weight.copy_(q)
        a0.k_proj.weight.copy_(torch.diag((torch.arange(d) < T).float()))
        token_dims = torch.diag((torch.arange(d) >= T).float())
        a0.v_proj.weight.copy_(token_dims)
        a0.o_proj.weight.copy_(eye)
        a1.q_proj.weight.copy_(token_dims)
        a1.k_proj.weight.copy_(token_dims)
    return model


def test_ideal_binding_circuit_scores_one():
    out = progress_measures(ideal_binding_model(), TASK, probe_batch())
    assert out["qk1_num_to_prev_var"] == 1.0
    assert out["qk2_ov1_var_identity"] == 1.0
    assert out["attn_l1_num_to_prev"] > 0.99
    assert out["attn_l1_equal_to_operands"] > 0.99
    assert out["probe_l1_var_from_num"] == 1.0


def test_broken_binding_circuit_scores_low():
    model = ideal_binding_model()
    var_dims = torch.arange(T + TASK.var_offset, T + V)
    perm = torch.roll(var_dims, 1)
    with torch.no_grad():
        a0, a1 = model.layers[0].self_attn, model.layers[1].self_attn
        a0.q_proj.weight.copy_(a0.q_proj.weight.roll(1, dims=0))  # looks two tokens back
        k = a1.k_proj.weight.clone()
        k[var_dims] = k[perm]  # keys permuted among variables: never the same variable
        a1.k_proj.weight.copy_(k)
    out = progress_measures(model, TASK, probe_batch())
    # Row 2 has the single candidate 1, so the floor is 1 / (prefix - 2).
    assert out["qk1_num_to_prev_var"] == pytest.approx(1 / (TASK.prefix_len - 2), rel=1e-6)
    assert out["qk2_ov1_var_identity"] == 0.0
    assert out["attn_l1_num_to_prev"] < 0.01
    with torch.no_grad():
        a0.v_proj.weight.zero_()  # layer 0 copies nothing into the number positions
    assert progress_measures(model, TASK, probe_batch())["probe_l1_var_from_num"] < 0.5


def test_qk_scores_is_the_bilinear_form():
    model = ArithTransformer(ArithConfig(hidden_size=12, head_dim=4, num_attention_heads=3,
                                         intermediate_size=8))
    x, y = torch.randn(5, 12), torch.randn(7, 12)
    attn = model.layers[1].self_attn
    wq = attn.q_proj.weight.view(3, 4, 12)
    wk = attn.k_proj.weight.view(3, 4, 12)
    expected = torch.einsum("nd,hed,hef,mf->hnm", x, wq, wk, y) / 2.0
    torch.testing.assert_close(qk_scores(model, 1, x, y), expected)


def lookup_addition_model(n: int = 7) -> ArithTransformer:
    """An exact OV-MLP adder without biases: ``OV(e_a) = u_a + u_bias``; neuron (i, j), i < j,
    fires on ``u_i + u_j - 0.75 u_bias``, neuron (i, i) on ``2 u_i - 1.5 u_bias``; each writes the
    answer's direction, which the unembedding reads."""
    pairs = [(i, j) for i in range(n) for j in range(i, n)]
    d = n + 1 + 2  # numbers, bias, room for the two variables' embeddings
    config = ArithConfig(modulus=n, num_variables=2, hidden_size=d, head_dim=d,
                         intermediate_size=len(pairs))
    model = zero_model(**config.to_diff_dict())
    with torch.no_grad():
        emb = torch.zeros(config.vocab_size, d)
        emb[:n, :n] = torch.eye(n)
        emb[:n, n] = 1.0
        model.embed_tokens.weight.copy_(emb)
        attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
        attn.v_proj.weight.copy_(torch.eye(d))
        attn.o_proj.weight.copy_(torch.eye(d))
        up = torch.zeros(len(pairs), d)
        down = torch.zeros(d, len(pairs))
        for k, (i, j) in enumerate(pairs):
            up[k, i] += 1.0
            up[k, j] += 1.0
            up[k, n] = -0.75 if i != j else -1.5
            down[(i + j) % n, k] = 1.0
        mlp.up_proj.weight.copy_(up)
        mlp.down_proj.weight.copy_(down)
        model.lm_head.weight.copy_(torch.eye(d)[:n])
    return model


def test_ov2_mlp2_accuracy_of_an_exact_adder_is_one():
    n = 7
    model = lookup_addition_model(n)
    logits, pre = ov2_mlp2_logits(model)
    assert logits.shape == (n, n, n) and pre.shape[:2] == (n, n)
    task = ArithTask(modulus=n, num_variables=2, seq_len=8)
    out = progress_measures(model, task, probe_batch(task, 64))
    assert out["ov2_mlp2_accuracy"] == 1.0
    with torch.no_grad():  # a wrong answer direction for one neuron breaks exactly its pair
        model.layers[1].mlp.down_proj.weight[:, 1] = torch.roll(
            model.layers[1].mlp.down_proj.weight[:, 1], 1)
    out = progress_measures(model, task, probe_batch(task, 64))
    assert out["ov2_mlp2_accuracy"] == pytest.approx(1 - 2 / n**2, rel=1e-6)  # (0,1), (1,0)


def test_fourier_analysis_recovers_a_planted_frequency():
    n, k = 59, 11
    w = 2 * math.pi * k / n
    a = torch.arange(n, dtype=torch.float64)
    planted = (torch.cos(w * a + 0.4)[:, None] + 0.7 * torch.cos(w * a - 1.1)[None, :] + 0.3)
    other = torch.cos(2 * math.pi * 3 * a / n)[:, None] + torch.sin(2 * math.pi * 20 * a / n)
    noise = torch.randn(n, n, dtype=torch.float64)
    pre = torch.stack([planted, other, noise], -1).float()
    result = fourier_analysis(pre)
    assert result["best_frequency"][0] == k
    assert result["explained_variance"][0] > 1 - 1e-5
    torch.testing.assert_close(result["fit"][..., 0], pre[..., 0], atol=1e-5, rtol=0)
    # two frequencies: the best single one explains half of the variance
    assert abs(result["explained_variance"][1].item() - 0.5) < 1e-4
    assert result["explained_variance"][2] < 0.1
    torch.testing.assert_close(result["variance"], pre.var(dim=(0, 1), unbiased=False))
