"""Tests of modeling/air/analysis_air.py and eval_harness/family/air_plots.py on tiny random models:
vectorised statistics against slow per-query loops read off ``solve``'s own trace."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from modeling.air import AIRConfig, AIRSolver
from modeling.air import analysis_air as air
from modeling.air.maze_air import OPEN, PAD, PATH, WALL
from modeling.air.sudoku_air import BLANK


def tiny(**overrides) -> AIRSolver:
    torch.manual_seed(0)
    cfg = dict(vocab_size=6, seq_len=16, hidden_size=16, num_hidden_layers=2,
               num_attention_heads=2, halt_max_steps=3)
    cfg.update(overrides)
    model = AIRSolver(AIRConfig(**cfg)).eval()
    with torch.no_grad():  # make the state prefix and level tokens matter to the attention
        if model.puzzle_emb is not None:
            model.puzzle_emb.weight.normal_()
        if model.level_emb is not None:
            model.level_emb.normal_()
    return model


def inputs(rows: int = 3, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 6, (rows, 16), generator=g)
    return torch.where(torch.rand(rows, 16, generator=g) < 0.6, BLANK, ids)


LEVEL_TOKEN_CASES = [dict(), dict(level_token="prepend_strip", injection="L2x_H2x"),
                     dict(level_token="prepend_no_strip", injection="L2x_H2x"),
                     dict(puzzle_emb_len=0)]


# ---------------------------------------------------------------------------- decoded statistics
def test_content_change_counts_every_transition_including_blank_and_pad():
    tokens = torch.tensor([[[2, 3, 1, 0]], [[2, 4, 2, 0]], [[1, 4, 2, 1]], [[1, 4, 2, 1]]])
    assert air.content_change(tokens).tolist() == [[2], [2], [0]]
    two = torch.tensor([[[1, 1], [2, 2]], [[1, 2], [2, 2]]])  # [T=2, B=2, S=2]
    assert air.content_change(two).tolist() == [[1, 0]]
    with pytest.raises(ValueError, match="sub_steps"):
        air.content_change(torch.zeros(3, 4))


def test_undecided_fraction_is_the_share_of_undecided_cells():
    tokens = torch.tensor([[[1, 1, 2, 3], [0, 2, 2, 2]], [[2, 2, 2, 2], [1, 1, 1, 1]]])
    assert air.undecided_fraction(tokens, BLANK).tolist() == [[0.5, 0.0], [0.0, 1.0]]
    assert air.undecided_fraction(tokens, PAD).tolist() == [[0.0, 0.25], [0.0, 0.0]]


def test_rollout_shapes_and_its_last_z_H_is_solves_prediction():
    model, ids = tiny(), inputs()
    roll = air.rollout(model, ids, segments=2)
    assert roll.levels == list(model.config.sub_steps) * 2
    assert roll.segment == [0] * 6 + [1] * 6
    assert roll.z_H.shape == roll.z_L.shape == (12, 3, 16)
    assert torch.equal(roll.z_H[-1], model.solve(ids, max_segments=2).predictions)
    sol = model.solve(ids, max_segments=2, return_trace=True, return_intermediate=True)
    assert torch.equal(roll.z_L[6:], sol.trace[1].z_L_logits.argmax(-1))
    single = air.rollout(tiny(single_state=True), ids, segments=1)
    assert single.z_L is None and single.z_H.shape == (6, 3, 16)


def test_freeze_experiment_leaves_the_frozen_state_unchanged():
    model, ids = tiny(), inputs()
    result = air.freeze_experiment(model, ids, segments=2)
    modes = result["modes"]
    assert set(modes) == {"normal", "freeze_H", "freeze_L"}
    assert modes["freeze_H"]["z_H"]["total_mean"] == 0.0
    assert modes["freeze_L"]["z_L"]["total_mean"] == 0.0
    assert modes["freeze_H"]["z_H"]["curve"] == [0.0] * 11
    roll = air.rollout(model, ids, segments=2)
    change = air.content_change(roll.z_L).double()
    assert modes["normal"]["z_L"]["total_mean"] == pytest.approx(float(change.sum(0).mean()))
    assert modes["normal"]["z_L"]["curve"] == pytest.approx(change.mean(1).tolist())
    assert modes["normal"]["z_L"]["total_mean"] > 0  # the recurrence moves z_L


# ---------------------------------------------------------------------------- neighbourhoods
def test_sudoku_neighbourhood_of_4x4_cells():
    nb = air.sudoku_neighbourhood(4)
    assert set(nb[0].nonzero().flatten().tolist()) == {1, 2, 3, 4, 8, 12, 5}
    assert set(nb[5].nonzero().flatten().tolist()) == {4, 6, 7, 1, 9, 13, 0}
    assert set(nb[15].nonzero().flatten().tolist()) == {12, 13, 14, 3, 7, 11, 10}
    assert (nb.sum(1) == 7).all() and torch.equal(nb, nb.T) and not nb.diagonal().any()
    assert (air.sudoku_neighbourhood(9).sum(1) == 20).all()
    six = air.sudoku_neighbourhood(6)  # boxes of 2 rows x 3 columns
    assert set(six[0].nonzero().flatten().tolist()) == {1, 2, 3, 4, 5, 6, 12, 18, 24, 30, 7, 8}


def test_violated_cells_on_a_hand_made_grid():
    solved = np.array([[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]) + 1
    assert not air.violated_cells(torch.tensor(solved.reshape(-1)), 4).any()
    grid = solved.copy()
    grid[3, 3] = 4 + 1  # digit 4 again in row 3, column 3 and the bottom-right box
    grid[2, 0] = BLANK  # undecided cells are never violated
    grid[0, 0] = PAD
    got = air.violated_cells(torch.tensor(grid.reshape(-1)), 4)
    assert set(got.nonzero().flatten().tolist()) == {15, 12, 3, 10}
    batch = torch.tensor(np.stack([solved.reshape(-1), grid.reshape(-1)]))
    assert air.violated_cells(batch, 4).sum(-1).tolist() == [0, 4]


def test_maze_neighbourhoods_are_clipped_squares_without_the_cell():
    hoods = air.maze_neighbourhoods(5, window=2)
    assert set(hoods["n4"][12].nonzero().flatten().tolist()) == {7, 11, 13, 17}
    assert set(hoods["n8"][0].nonzero().flatten().tolist()) == {1, 5, 6}
    assert hoods["window"][12].sum() == 24 and hoods["window"][0].sum() == 8
    assert air.maze_neighbourhoods(7, window=3)["window"][24].sum() == 48


# ---------------------------------------------------------------------------- slow references
def _cell_start(cfg) -> int:
    """Written from the layout in the brief, independently of model.state_offset."""
    return (int(cfg.level_token == "prepend_strip") + cfg.puzzle_emb_len
            + int(cfg.level_token == "prepend_no_strip"))


def _per_head(weights, start, q, S, groups):
    """Slow per-query statistics from one layer's ``[heads, S_total, S_total]`` weights: head-mean
    mass on each key set in ``groups`` and head-mean entropy over the renormalised cells."""
    heads = weights.shape[0]
    mass = {name: 0.0 for name in groups}
    ent = 0.0
    for h in range(heads):
        row = [float(weights[h, start + q, start + k]) for k in range(S)]
        total = sum(row)
        p = [w / total for w in row]
        for name, keys in groups.items():
            mass[name] += sum(p[k] for k in keys) / heads
        ent += -sum(x * math.log(x) for x in p if x > 0) / heads
    return mass, ent


def _trace_states(model, ids, segments):
    sol = model.solve(ids, max_segments=segments, return_trace=True, return_intermediate=True,
                      output_attentions=True)
    z0 = model.decode(model.initial_states(ids.shape[0])[0]).argmax(-1)
    entering = [z0] + [seg.z_H_logits[-1].argmax(-1) for seg in sol.trace[:-1]]
    return sol.trace, entering


def slow_sudoku(model, ids, size, segments):
    cfg = model.config
    S, start = size * size, _cell_start(cfg)
    br, bc = {4: (2, 2), 6: (2, 3), 9: (3, 3)}[size]
    steps = list(cfg.sub_steps)
    iL, iH = steps.index("L"), steps.index("H")

    def hood(q):
        r, c = divmod(q, size)
        return {k for k in range(S) if k != q and (
            k // size == r or k % size == c
            or (k // size // br == r // br and k % size // bc == c // bc))}

    out = {}
    trace, entering = _trace_states(model, ids, segments)
    for s, seg in enumerate(trace):
        for b in range(ids.shape[0]):
            grid = entering[s][b].tolist()
            viol = {k for k in range(S) if grid[k] > BLANK
                    and any(grid[j] == grid[k] for j in hood(k))}
            for q in range(S):
                if ids[b, q] != BLANK:
                    continue
                N = hood(q)
                groups = {"N": N, "V": viol, "NV": N & viol, "NO": N - viol}
                rec = {k: [] for k in ("delta_N", "delta_ent", "delta_V", "delta_V_within")}
                for layer in range(cfg.num_hidden_layers):
                    mL, eL = _per_head(seg.attentions[iL][layer][b], start, q, S, groups)
                    mH, eH = _per_head(seg.attentions[iH][layer][b], start, q, S, groups)
                    rec["delta_N"].append(mL["N"] - mH["N"])
                    rec["delta_ent"].append(eH - eL)
                    rec["delta_V"].append(mL["V"] - mH["V"])
                    if groups["NV"] and groups["NO"]:
                        rec["delta_V_within"].append(
                            (mL["NV"] - mH["NV"]) / len(groups["NV"])
                            - (mL["NO"] - mH["NO"]) / len(groups["NO"]))
                    else:
                        rec["delta_V_within"].append(math.nan)
                rec["violation_adjacent"] = bool(N & viol)
                out[(s, b, q)] = rec
    return out


def slow_maze(model, ids, labels, size, segments, window):
    cfg = model.config
    S, start = size * size, _cell_start(cfg)
    steps = list(cfg.sub_steps)
    iL, iH = steps.index("L"), steps.index("H")

    def square(q, radius, cardinal=False):
        r, c = divmod(q, size)
        keys = set()
        for k in range(S):
            dr, dc = abs(k // size - r), abs(k % size - c)
            if k != q and max(dr, dc) <= radius and (not cardinal or dr + dc == 1):
                keys.add(k)
        return keys

    out = {}
    trace, entering = _trace_states(model, ids, segments)
    for s, seg in enumerate(trace):
        for b in range(ids.shape[0]):
            wrong = {k for k in range(S) if int(entering[s][b, k]) != int(labels[b, k])}
            for q in range(S):
                if labels[b, q] != PATH:
                    continue
                W = square(q, window)
                groups = {"n4": square(q, 1, True), "n8": square(q, 1), "window": W, "V": wrong,
                          "NV": W & wrong, "NO": W - wrong}
                rec = {}
                for layer in range(cfg.num_hidden_layers):
                    mL, eL = _per_head(seg.attentions[iL][layer][b], start, q, S, groups)
                    mH, eH = _per_head(seg.attentions[iH][layer][b], start, q, S, groups)
                    for name in ("n4", "n8", "window"):
                        rec.setdefault(f"delta_density_{name}", []).append(
                            (mL[name] - mH[name]) / len(groups[name]))
                    rec.setdefault("delta_ent", []).append(eH - eL)
                    rec.setdefault("delta_V", []).append(mL["V"] - mH["V"])
                    within = math.nan
                    if groups["NV"] and groups["NO"]:
                        within = ((mL["NV"] - mH["NV"]) / len(groups["NV"])
                                  - (mL["NO"] - mH["NO"]) / len(groups["NO"]))
                    rec.setdefault("delta_V_within", []).append(within)
                rec["error_adjacent"] = bool(W & wrong)
                out[(s, b, q)] = rec
    return out


def _compare(values, slow, flag):
    keys = list(zip(values["segment"].tolist(), values["row"].tolist(), values["cell"].tolist(),
                    strict=True))
    assert sorted(keys) == sorted(slow) and len(keys) == len(set(keys))
    for i, key in enumerate(keys):
        ref = slow[key]
        assert bool(values[flag][i]) == ref[flag], key
        for name, expected in ref.items():
            if name != flag:
                np.testing.assert_allclose(values[name][i], expected, rtol=1e-6, atol=1e-9,
                                           err_msg=f"{name} at {key}")


@pytest.mark.parametrize("overrides", LEVEL_TOKEN_CASES)
def test_sudoku_locality_matches_a_slow_per_query_loop(overrides):
    model, ids = tiny(**overrides), inputs()
    assert model.solve(ids, max_segments=1, return_trace=True, output_attentions=True
                       ).trace[0].attentions[0][0].shape[-1] == _cell_start(model.config) + 16
    values = air.sudoku_locality_values(model, ids, 4, segments=2, batch_size=2)
    slow = slow_sudoku(model, ids, 4, 2)
    _compare(values, slow, "violation_adjacent")
    assert values["violation_adjacent"].any()
    assert values["delta_N"].shape == (len(slow), 2)


@pytest.mark.parametrize("overrides", LEVEL_TOKEN_CASES[:2])
def test_maze_locality_matches_a_slow_per_query_loop(overrides):
    model = tiny(**overrides)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(WALL, 5, (2, 16), generator=g)
    labels = torch.where(torch.rand(2, 16, generator=g) < 0.4, PATH, ids)
    labels[:, 0] = OPEN
    values = air.maze_locality_values(model, ids, labels, 4, segments=2, window=2, batch_size=1)
    _compare(values, slow_maze(model, ids, labels, 4, 2, 2), "error_adjacent")


def test_summaries_have_per_layer_means_and_normal_cis():
    model, ids = tiny(), inputs()
    result = air.sudoku_attention_locality(model, ids, 4, segments=2)
    values = air.sudoku_locality_values(model, ids, 4, segments=2)
    x = values["delta_N"][:, 1]
    stat = result["stats"]["delta_N"]["all"]
    assert stat["mean"][1] == pytest.approx(x.mean())
    assert stat["ci95"][1] == pytest.approx(1.96 * x.std(ddof=1) / math.sqrt(len(x)), rel=1e-3)
    assert stat["n"] == [len(x)] * 2
    adj = result["queries"]["violation_adjacent"]
    assert adj + result["queries"]["control"] == result["queries"]["all"] == len(x)
    maze = air.maze_attention_locality(model, ids, torch.where(ids == BLANK, PATH, ids), 4,
                                       segments=1)
    assert set(maze["stats"]) == {"delta_density_n4", "delta_density_n8",
                                  "delta_density_window", "delta_ent", "delta_V",
                                  "delta_V_within"}
    assert len(maze["stats"]["delta_ent"]["control"]["mean"]) == 2


# ---------------------------------------------------------------------------- plots and report
def test_write_report_end_to_end(tmp_path):
    from eval_harness.family import air_plots

    run = tmp_path / "run"
    model = tiny(halt_max_steps=2)
    model.save_pretrained(run / "final")
    with pytest.raises(ValueError, match="log.json"):
        air_plots.write_report(run, tmp_path / "out")
    history = [{"step": s, "lm_loss": 1.5 / s, "loss": 1.6 / s, "train_exact_accuracy": s / 20,
                "eval": {"exact_accuracy": s / 40, "token_accuracy": 0.5 + s / 40}}
               for s in (1, 5, 10)]
    (run / "log.json").write_text(json.dumps({
        "history": history, "model_config": model.config.to_dict(),
        "train_config": {"task": "sudoku"}}))
    paths = air_plots.write_report(run, tmp_path / "out", puzzles=4)
    names = {p.name for p in paths}
    assert names == {"training.png", "rollout.png", "freeze.png", "locality.png", "summary.json"}
    for p in paths:
        assert p.is_file() and p.stat().st_size > 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {"task", "size", "puzzles", "exact_accuracy", "token_accuracy", "undecided_fraction",
            "freeze", "locality"} <= set(summary)
    assert summary["size"] == 4 and summary["puzzles"] == 4
    assert summary["freeze"]["modes"]["freeze_H"]["z_H"]["total_mean"] == 0.0
    assert len(summary["undecided_fraction"]["z_H"]) == 12
    bare = tmp_path / "bare"
    (bare).mkdir()
    (bare / "log.json").write_text(json.dumps({"history": []}))
    with pytest.raises(ValueError, match="final"):
        air_plots.write_report(bare, tmp_path / "out2")


def test_maze_rollout_plot(tmp_path):
    from eval_harness.family import air_plots

    model = tiny()
    ids = torch.tensor([[3, 2, 2, 1, 1, 1, 2, 1, 2, 2, 2, 1, 1, 1, 4, 1]])
    labels = torch.tensor([[3, 5, 5, 1, 1, 1, 5, 1, 2, 2, 5, 1, 1, 1, 4, 1]])
    path = air_plots.plot_rollout(model, ids, labels, "maze", tmp_path / "maze.png", segments=1)
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="task"):
        air_plots.plot_rollout(model, ids, labels, "chess", tmp_path / "x.png")
