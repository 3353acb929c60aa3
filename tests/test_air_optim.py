"""AdamATan2 against its from-the-formulas reference, the warmup/cosine schedule and the EMA."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from modeling.air.optim_air import (
    EMA,
    AdamATan2,
    adam_atan2_reference_step,
    make_scheduler,
    warmup_schedule,
)


def _model(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3)).to(dtype)


def _grads(model: nn.Module, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in model.parameters()]
        for _ in range(steps)
    ]


def _run(model: nn.Module, opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------- AdamATan2


@pytest.mark.parametrize(
    ("lr", "betas", "wd", "a", "b"),
    [(1e-2, (0.9, 0.95), 0.0, 1.27, 1.0), (3e-2, (0.8, 0.99), 0.1, 0.5, 2.0)],
)
def test_matches_reference_over_steps(lr, betas, wd, a, b):
    model = _model()
    start = _params(model)
    grads = _grads(model, steps=7)
    grads[3][0].zero_()  # a zero gradient mid-run
    _run(model, AdamATan2(model.parameters(), lr=lr, betas=betas, weight_decay=wd, a=a, b=b), grads)

    for i, p0 in enumerate(start):
        p, m, v = p0, torch.zeros_like(p0), torch.zeros_like(p0)
        for t, step_grads in enumerate(grads, start=1):
            p, m, v = adam_atan2_reference_step(
                p, step_grads[i], m, v, t, lr, betas=betas, weight_decay=wd, a=a, b=b
            )
        torch.testing.assert_close(list(model.parameters())[i].detach(), p, rtol=0, atol=1e-12)


def test_first_step_closed_form_in_a_and_b():
    # At t=1, m_hat = g and sqrt(v_hat) = |g|, so the update is a * sign(g) * atan(1 / b).
    for a, b in [(1.27, 1.0), (2.0, 1.0), (1.0, 0.5), (0.3, 4.0)]:
        p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64))
        g = torch.tensor([0.3, -7.0, 1e-8, 0.0], dtype=torch.float64)
        p.grad = g.clone()
        lr = 0.1
        AdamATan2([p], lr=lr, a=a, b=b).step()
        expected = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
        expected -= lr * a * torch.sign(g) * math.atan(1.0 / b)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-15)


def test_update_bounded_by_lr_a_pi_over_2():
    lr, a = 0.05, 1.27
    model = _model()
    grads = _grads(model, steps=6)
    for k, step_grads in enumerate(grads):  # wildly varying scales and signs
        for g in step_grads:
            g.mul_(10.0 ** (6 * (-1) ** k))
    opt = AdamATan2(model.parameters(), lr=lr, a=a)
    bound = lr * a * math.pi / 2
    for step_grads in grads:
        before = _params(model)
        _run(model, opt, [step_grads])
        for p0, p in zip(before, model.parameters(), strict=True):
            assert ((p.detach() - p0).abs() <= bound * (1 + 1e-12)).all()
    # The bound is approached: first step atan2(g, b * |g|) -> pi / 2 as b -> 0.
    p = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = AdamATan2([p], lr=lr, a=a, b=1e-9)
    p.grad = torch.tensor([1.0], dtype=torch.float64)
    opt.step()
    assert -p.item() == pytest.approx(bound, rel=1e-8)


@pytest.mark.parametrize("c", [4.0, 1e-3, 37.5])
def test_invariant_to_gradient_scale(c):
    grads = _grads(_model(), steps=6)
    runs = []
    for scale in (1.0, c):
        model = _model()
        scaled = [[g * scale for g in step_grads] for step_grads in grads]
        _run(model, AdamATan2(model.parameters(), lr=1e-2, weight_decay=0.1), scaled)
        runs.append(_params(model))
    for p1, pc in zip(*runs, strict=True):
        torch.testing.assert_close(p1, pc, rtol=0, atol=1e-14)


def test_weight_decay_is_decoupled():
    lr, wd = 1e-2, 0.3
    grads = _grads(_model(), steps=1)
    plain, decayed = _model(), _model()
    start = _params(plain)
    opt_plain = AdamATan2(plain.parameters(), lr=lr)
    opt_decayed = AdamATan2(decayed.parameters(), lr=lr, weight_decay=wd)
    _run(plain, opt_plain, grads)
    _run(decayed, opt_decayed, grads)
    for p0, pp, pd in zip(start, plain.parameters(), decayed.parameters(), strict=True):
        # p_plain - p_decayed = lr * wd * p0: the decay never enters the gradient ...
        torch.testing.assert_close(pp - pd, lr * wd * p0, rtol=0, atol=1e-15)
        # ... so the moments are those of the raw gradients.
        assert torch.equal(opt_plain.state[pp]["exp_avg"], opt_decayed.state[pd]["exp_avg"])
        assert torch.equal(opt_plain.state[pp]["exp_avg_sq"], opt_decayed.state[pd]["exp_avg_sq"])
    # With a zero gradient the step is pure shrinkage.
    p = nn.Parameter(torch.tensor([2.0, -4.0], dtype=torch.float64))
    p.grad = torch.zeros(2, dtype=torch.float64)
    AdamATan2([p], lr=lr, weight_decay=wd).step()
    assert torch.equal(p.detach(), torch.tensor([2.0, -4.0], dtype=torch.float64) * (1 - lr * wd))


def test_state_dict_round_trip_continues_identically():
    grads = _grads(_model(), steps=8)
    model = _model()
    opt = AdamATan2(
        [
            {"params": model[0].parameters(), "lr": 3e-2, "b": 2.0},
            {"params": [*model[1].parameters(), *model[2].parameters()]},
        ],
        lr=1e-2,
        weight_decay=0.05,
    )
    _run(model, opt, grads[:4])
    resumed_model = copy.deepcopy(model)
    saved = copy.deepcopy(opt.state_dict())
    _run(model, opt, grads[4:])

    resumed = AdamATan2(
        [
            {"params": resumed_model[0].parameters()},
            {"params": [*resumed_model[1].parameters(), *resumed_model[2].parameters()]},
        ],
        lr=1.0,
    )
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["b"] == 2.0 and resumed.param_groups[1]["lr"] == 1e-2
    _run(resumed_model, resumed, grads[4:])
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_closure_and_params_without_grad():
    model = _model()
    x = torch.randn(2, 5, dtype=torch.float64)
    opt = AdamATan2(model.parameters(), lr=1e-2)
    frozen = _params(model)[-1]

    def closure():
        opt.zero_grad()
        loss = model[:2](x).sum()  # the last Linear gets no gradient
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert torch.equal(list(model.parameters())[-1].detach(), frozen)
    assert list(model.parameters())[-1] not in opt.state


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -1e-3}, "lr"),
        ({"betas": (1.0, 0.95)}, "betas[0]"),
        ({"betas": (0.9, -0.1)}, "betas[1]"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"a": 0.0}, "a must"),
        ({"b": -1.0}, "b must"),
    ],
)
def test_argument_errors(kwargs, name):
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        AdamATan2(params, **kwargs)
    group = {"params": params, **kwargs}
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        AdamATan2([group])


def test_sparse_gradients_rejected():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamATan2(emb.parameters(), lr=1e-3).step()


# --------------------------------------------------------------------------- schedule


def test_warmup_schedule_shape():
    w, total, lo = 10, 50, 0.1
    values = [warmup_schedule(s, w, total, lo) for s in range(total + 5)]
    assert values[0] == 0.0
    assert values[w] == 1.0
    assert values[total] == pytest.approx(lo, abs=1e-15)
    assert all(v == pytest.approx(lo, abs=1e-15) for v in values[total:])
    assert values[w // 2] == 0.5
    warm, decay = values[: w + 1], values[w : total + 1]
    assert all(x < y for x, y in zip(warm, warm[1:], strict=False))
    assert all(x > y for x, y in zip(decay, decay[1:], strict=False))
    assert values[(w + total) // 2] == pytest.approx((1 + lo) / 2)  # cosine midpoint
    # min_ratio=1.0 (the default) is constant after warmup; no warmup starts at 1.
    assert [warmup_schedule(s, 4, 20) for s in range(4, 30)] == [1.0] * 26
    assert warmup_schedule(0, 0, 20, 0.0) == 1.0 and warmup_schedule(20, 0, 20, 0.0) == 0.0


@pytest.mark.parametrize(
    ("args", "name"),
    [((-1, 10, 0.5), "warmup_steps"), ((5, 4, 0.5), "total_steps"), ((5, 10, 1.5), "min_ratio")],
)
def test_warmup_schedule_errors(args, name):
    with pytest.raises(ValueError, match=name):
        warmup_schedule(0, *args)
    with pytest.raises(ValueError, match=name):
        make_scheduler(AdamATan2([nn.Parameter(torch.zeros(1))]), *args)


def test_make_scheduler_drives_every_group():
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = AdamATan2([{"params": [p], "lr": 2e-3}, {"params": [q]}], lr=1e-3)
    sched = make_scheduler(opt, warmup_steps=4, total_steps=12, min_ratio=0.25)
    seen = []
    for _ in range(14):
        seen.append([g["lr"] for g in opt.param_groups])
        p.grad, q.grad = torch.ones(1), torch.ones(1)
        opt.step()
        sched.step()
    for step, (lr_p, lr_q) in enumerate(seen, start=1):  # the authors count steps from 1
        mult = warmup_schedule(step, 4, 12, 0.25)
        assert lr_p == pytest.approx(2e-3 * mult) and lr_q == pytest.approx(1e-3 * mult)
    assert seen[0] == pytest.approx([2e-3 / 4, 1e-3 / 4])  # lr * t / warmup at t = 1, never 0
    assert seen[3] == pytest.approx([2e-3, 1e-3]) and seen[11] == pytest.approx([5e-4, 2.5e-4])


# --------------------------------------------------------------------------- EMA


def test_ema_is_the_geometric_average():
    decay = 0.9
    model = _model()
    model[1].register_buffer("counter", torch.zeros((), dtype=torch.long))
    history = [_params(model)]
    ema = EMA(model, decay=decay)
    gen = torch.Generator().manual_seed(3)
    for n in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            model[1].counter.fill_(n)
        history.append(_params(model))
        ema.update(model)
    n = len(history) - 1
    for i, shadow in enumerate(ema.shadow.values()):
        # e_n = d^n theta_0 + (1 - d) * sum_k d^(n-k) theta_k
        expected = decay**n * history[0][i] + sum(
            (1 - decay) * decay ** (n - k) * history[k][i] for k in range(1, n + 1)
        )
        torch.testing.assert_close(shadow, expected, rtol=0, atol=1e-14)
    assert ema.buffers["1.counter"].item() == 5  # buffers are copied, not averaged


def test_ema_swapped_restores_bit_exactly_even_on_error():
    model = _model(dtype=torch.float32)
    model[1].register_buffer("stat", torch.tensor([1.5, 2.5]))
    ema = EMA(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model[1].stat.mul_(3)
    ema.update(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.7).add_(0.1)
        model[1].stat.add_(1)
    training = copy.deepcopy(model.state_dict())

    with ema.swapped(model) as swapped:
        assert swapped is model
        for name, p in model.named_parameters():
            assert torch.equal(p, ema.shadow[name])
        assert torch.equal(model[1].stat, ema.buffers["1.stat"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, training[key])

    with pytest.raises(KeyError), ema.swapped(model):
        raise KeyError("boom")
    for key, value in model.state_dict().items():
        assert torch.equal(value, training[key])

    ema.copy_to(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, ema.shadow[name])


def test_ema_state_dict_round_trip_and_errors():
    model = _model()
    ema = EMA(model, decay=0.99)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    other = EMA(_model(seed=5), decay=0.5)
    other.load_state_dict(ema.state_dict())
    assert other.decay == 0.99
    for name in ema.shadow:
        assert torch.equal(other.shadow[name], ema.shadow[name])
    ema.update(model)
    other.update(model)
    for name in ema.shadow:
        assert torch.equal(other.shadow[name], ema.shadow[name])

    for decay in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="decay"):
            EMA(model, decay=decay)
    with pytest.raises(ValueError, match="names"):
        ema.update(nn.Linear(5, 4))


def test_ema_keeps_half_precision_models_in_float32():
    model = _model(dtype=torch.bfloat16)
    ema = EMA(model, decay=0.999)
    assert all(t.dtype == torch.float32 for t in ema.shadow.values())
    ema.update(model)
    with ema.swapped(model):
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
