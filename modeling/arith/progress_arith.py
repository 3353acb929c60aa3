"""Progress measures (the paper's appendix B) and the Fourier check of the last MLP (section 5.1).

Weight-based measures read the circuits straight from the parameters; activation-based ones run
the model on a fixed batch from :func:`~.data_arith.sample_batch`. Layer indices are 0-based in
code (``layer 0`` is the paper's "layer 1"). With several heads, QK measures take the best head.

Circuits (row-vector convention, ``x W`` with ``W = Linear.weight.T``):
``OV_l(x) = x W_V^l W_O^l``; ``QK_l(x, y) = (x W_Q^l)(y W_K^l)^T / sqrt(d_head)`` per head.
"""

from __future__ import annotations

import math

import torch

from .data_arith import ArithTask
from .modeling_arith import ArithTransformer

__all__ = [
    "fourier_analysis",
    "ov2_mlp2_logits",
    "progress_measures",
    "qk_scores",
]


def ov(model: ArithTransformer, layer: int, x: torch.Tensor) -> torch.Tensor:
    """``OV_layer(x)``: ``[..., D] -> [..., D]`` (sum over heads)."""
    attn = model.layers[layer].self_attn
    return attn.o_proj(attn.v_proj(x))


def qk_scores(
    model: ArithTransformer, layer: int, xq: torch.Tensor, xk: torch.Tensor
) -> torch.Tensor:
    """Pre-softmax attention scores ``[H, Nq, Nk]`` between query rows ``xq [Nq, D]`` and key
    rows ``xk [Nk, D]`` (no mask)."""
    attn = model.layers[layer].self_attn
    h, dh = attn.num_heads, attn.head_dim
    q = attn.q_proj(xq).view(-1, h, dh).transpose(0, 1)
    k = attn.k_proj(xk).view(-1, h, dh).transpose(0, 1)
    return q @ k.transpose(1, 2) / math.sqrt(dh)


def _mlp_layer(model: ArithTransformer) -> int:
    if not model.config.mlp_layers:
        raise ValueError("the OV-MLP circuit needs an MLP layer (config.mlp_layers is empty)")
    return model.config.mlp_layers[-1]


def ov2_mlp2_logits(model: ArithTransformer) -> tuple[torch.Tensor, torch.Tensor]:
    """The isolated addition circuit ``W_U MLP(OV(e_a) + OV(e_b))`` on all ``N^2`` pairs.

    Uses the last layer with an MLP. Returns ``(logits [N, N, N], pre [N, N, d_mlp])``, the
    logits and the MLP pre-activations indexed by ``(a, b)``.
    """
    layer = _mlp_layer(model)
    n = model.config.modulus
    numbers = model.embed_tokens.weight[:n]
    values = ov(model, layer, numbers)  # [N, D]
    x = values[:, None, :] + values[None, :, :]  # [N, N, D]
    mlp = model.layers[layer].mlp
    pre = mlp.up_proj(x)
    logits = model.lm_head(mlp.down_proj(mlp.act(pre)))
    return logits, pre


def fourier_analysis(pre: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fit every neuron's pre-activation ``pre [N, N, M]`` over operand pairs ``(a, b)`` by
    ``c + u cos(w a) + v sin(w a) + u' cos(w b) + v' sin(w b)``, ``w = 2 pi k / N``, for each
    frequency ``k = 1 .. (N - 1) // 2`` (least squares) and keep the best.

    On the full grid these five functions are orthogonal, so the least-squares coefficients are
    projections of the row / column means (``u = 2/N sum_a (r_a - mean) cos(w a)``, ...).

    Returns ``best_frequency [M]``, ``explained_variance [M]`` (R^2 of the best fit),
    ``fit [N, N, M]`` (the best fit), ``variance [M]`` (of the raw pre-activations).
    """
    n = pre.shape[0]
    y = pre.double()
    mean = y.mean((0, 1))
    rows = y.mean(1) - mean  # [N, M], the a-dependence
    cols = y.mean(0) - mean  # [N, M], the b-dependence
    k = torch.arange(1, (n - 1) // 2 + 1, dtype=torch.float64)
    angle = 2 * math.pi * k[:, None] * torch.arange(n, dtype=torch.float64)[None] / n  # [K, N]
    cos, sin = angle.cos(), angle.sin()
    ua, va = 2 / n * cos @ rows, 2 / n * sin @ rows  # [K, M]
    ub, vb = 2 / n * cos @ cols, 2 / n * sin @ cols
    explained = n * n / 2 * (ua**2 + va**2 + ub**2 + vb**2)  # [K, M]
    total = ((y - mean) ** 2).sum((0, 1)).clamp_min(1e-30)
    r2, best = (explained / total).max(0)
    m = torch.arange(y.shape[-1])
    fa = cos[best].T * ua[best, m] + sin[best].T * va[best, m]  # [N, M]
    fb = cos[best].T * ub[best, m] + sin[best].T * vb[best, m]
    fit = mean + fa[:, None, :] + fb[None, :, :]
    return {
        "best_frequency": best + 1,
        "explained_variance": r2.float(),
        "fit": fit.float(),
        "variance": (total / (n * n)).float(),
    }


def _ridge_probe_accuracy(
    x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
    classes: int, ridge: float = 1e-3,
) -> float:
    """Least-squares linear probe (one-hot targets, ridge ``ridge * trace/D``) -> test accuracy."""
    x = torch.cat([x_train, torch.ones(len(x_train), 1)], 1).double()
    target = torch.nn.functional.one_hot(y_train, classes).double()
    gram = x.T @ x
    gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    w = torch.linalg.solve(gram, x.T @ target)
    xt = torch.cat([x_test, torch.ones(len(x_test), 1)], 1).double()
    return ((xt @ w).argmax(1) == y_test).float().mean().item()


@torch.no_grad()
def progress_measures(
    model: ArithTransformer, task: ArithTask, batch: dict[str, torch.Tensor]
) -> dict[str, float]:
    """The appendix-B progress measures plus the Fourier summary, as plain floats.

    ``batch`` is a fixed draw of :func:`~.data_arith.sample_batch` (its first half trains the
    probe, its second half tests it). Measures (all in [0, 1]):

    - ``ov2_mlp2_accuracy``: argmax of ``W_U MLP(OV(e_a)+OV(e_b))`` equals ``(a+b) mod N``,
      over all ``N^2`` pairs.
    - ``qk1_num_to_prev_var``: fraction of prefix positions ``2 <= i < T-4`` whose layer-0
      position x position score ``QK(p_i, p_j)`` over ``j < i, j != i-2`` peaks at ``j = i-1``
      (the paper's figure 7a; row 2 has the single candidate 1, so the floor is ``1 / (T-6)``).
    - ``qk2_ov1_var_identity``: fraction of variables ``u`` for which
      ``QK_1(OV_0(e_u), OV_0(e_w))`` peaks at ``w = u``.
    - ``attn_l1_equal_to_operands``: layer-0 attention mass of ``=`` on the two operand slots.
    - ``attn_l1_num_to_prev``: layer-0 attention of assigned numbers to the preceding variable.
    - ``attn_l2_equal_to_values``: layer-1 attention mass of ``=`` on the operands' values (the
      assigned numbers for variables, the slots themselves for numbers).
    - ``probe_l1_var_from_num``: accuracy of a linear probe for the variable name from the
      residual stream of assigned numbers after layer-0 attention.
    - ``fourier_explained_variance``: median R^2 of the best single-frequency fit over the MLP
      neurons whose pre-activation variance exceeds 1% of the largest;
      ``fourier_num_frequencies``: distinct best frequencies among them (a count).
    """
    was_training = model.training
    model.eval()
    cfg = model.config
    n, p = task.modulus, task.prefix_len
    out: dict[str, float] = {}

    logits, pre = ov2_mlp2_logits(model)
    target = (torch.arange(n)[:, None] + torch.arange(n)[None, :]) % n
    out["ov2_mlp2_accuracy"] = (logits.argmax(-1) == target).float().mean().item()

    positions = model.embed_positions.weight
    scores = qk_scores(model, 0, positions[:p], positions[:p])  # [H, p, p]
    hits = []
    for i in range(2, p):
        cand = [j for j in range(i) if j != i - 2]
        best = torch.tensor(cand)[scores[:, i, cand].argmax(-1)]  # [H]
        hits.append(best == i - 1)
    out["qk1_num_to_prev_var"] = torch.stack(hits).float().mean(0).max().item()

    if cfg.num_hidden_layers >= 2:
        var_emb = model.embed_tokens.weight[cfg.variable_token_ids]
        mapped = ov(model, 0, var_emb)
        ident = qk_scores(model, 1, mapped, mapped).argmax(-1) == torch.arange(len(var_emb))
        out["qk2_ov1_var_identity"] = ident.float().mean(-1).max().item()

    ids = batch["input_ids"]
    res = model(ids, output_attentions=True, output_hidden_states=True)
    att0 = res.attentions[0].mean(1)  # [B, T, T], averaged over heads
    out["attn_l1_equal_to_operands"] = att0[:, -1, p + 1:p + 3].sum(-1).mean().item()
    is_num = (ids[:, :p] < n)
    is_num[:, 0] = False
    rows, cols = is_num.nonzero(as_tuple=True)
    out["attn_l1_num_to_prev"] = att0[rows, cols, cols - 1].mean().item()
    if cfg.num_hidden_layers >= 2:
        att1 = res.attentions[1].mean(1)[:, -1]  # [B, T] from "="
        b = torch.arange(len(ids))
        mass = att1[b, batch["lhs_src"]] + att1[b, batch["rhs_src"]]
        out["attn_l2_equal_to_values"] = mass.mean().item()

    resid = res.hidden_states[1][rows, cols]  # after layer-0 attention, at assigned numbers
    var = ids[rows, cols - 1] - task.var_offset
    half = len(ids) // 2
    train, test = rows < half, rows >= half
    out["probe_l1_var_from_num"] = _ridge_probe_accuracy(
        resid[train], var[train], resid[test], var[test], task.num_variables)

    fourier = fourier_analysis(pre)
    live = fourier["variance"] > 0.01 * fourier["variance"].max()
    out["fourier_explained_variance"] = fourier["explained_variance"][live].median().item()
    out["fourier_num_frequencies"] = float(fourier["best_frequency"][live].unique().numel())
    model.train(was_training)
    return out
