"""Analyses of *One Model, Two Roles* on a trained :class:`AIRSolver` (sections 4, 6, 7; appendices
E and F of the paper).

- :func:`rollout` — both states decoded after every sub-step of the first ``segments`` segments;
- :func:`content_change` / :func:`undecided_fraction` — the section-6 content-change metric and
  the section-4 "fully committed z_H / partially committed z_L" statistic;
- :func:`freeze_experiment` — paired freeze experiments (section 6, figure 6);
- :func:`sudoku_attention_locality` / :func:`maze_attention_locality` — the L- versus H-update
  attention contrasts (section 7, appendices E and F), per layer, with 95% confidence intervals.

Conventions:

* Sub-steps are counted over all segments run from fresh states (``solve``'s ``halting="max"``
  schedule): with the default pattern ``L,L,H,L,L,H`` and ``k`` segments there are ``6k``
  decodings per state. Decodings are argmax tokens of the output head (``model.decode``).
* Attention is read over the cell positions only: the block input holds, in order, the level
  token (``level_token="prepend_strip"`` only), ``model.state_offset`` prefix positions (puzzle
  embedding, and the level token under ``"prepend_no_strip"``), then the ``seq_len`` cells. The
  weights from a query cell to the cell keys are renormalised to sum to one over the cells.
* Each segment's FIRST L-update is compared with its FIRST H-update. Both read the same z_H (only
  L-updates run between the segment start and the first H-update), so the "currently decoded
  z_H" that defines violated (Sudoku) or wrong (Maze) cells is z_H as it enters the segment
  (for the first segment: the decoded initial state, which is the same token at every cell, so
  that segment's violated set is either empty or every digit-decoded cell).
* Per query, masses are averaged over heads (mass is linear, so averaging weights first is the
  same); entropies are computed per head, in nats, then averaged.
* Confidence intervals: ``mean ± 1.96 · sd / sqrt(n)`` over query cells (normal approximation,
  sample standard deviation). Queries of the same puzzle and of different segments are treated
  as independent, so the intervals are optimistic about correlated queries.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .maze_air import PATH
from .sudoku_air import BLANK, SudokuSpec

__all__ = [
    "Rollout",
    "content_change",
    "freeze_experiment",
    "maze_attention_locality",
    "maze_locality_values",
    "maze_neighbourhoods",
    "sudoku_attention_locality",
    "sudoku_locality_values",
    "sudoku_neighbourhood",
    "summarise",
    "undecided_fraction",
    "violated_cells",
]

Z = 1.959963984540054  # two-sided 95% normal quantile


# ---------------------------------------------------------------------------- running the model
def _as_ids(model, input_ids) -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(input_ids) if not torch.is_tensor(input_ids) else input_ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    return ids.long().to(model.device)


def _segments(model, input_ids: torch.Tensor, segments: int | None, freeze_state: str | None,
              puzzle_identifiers, intermediate: bool, attentions: bool
              ) -> Iterator[tuple[int, torch.Tensor, dict]]:
    """``(segment, z_H entering it, run_segment trace)`` from :meth:`AIRSolver.iter_segments`,
    the schedule :meth:`AIRSolver.solve` runs (fresh states, every row for ``segments``)."""
    if puzzle_identifiers is not None:
        puzzle_identifiers = torch.as_tensor(puzzle_identifiers).long().to(input_ids.device)
    runs = model.iter_segments(input_ids, puzzle_identifiers, segments, freeze_state,
                               intermediate, attentions)
    for s, (z_H_in, _, _, trace) in enumerate(runs):
        yield s, z_H_in, trace


@dataclass
class Rollout:
    """Decoded states after every sub-step.

    Attributes:
        levels: the level of every sub-step over all segments (``["L","L","H", ...]``).
        segment: the segment each sub-step belongs to.
        z_H, z_L: argmax tokens ``[n_sub_steps, B, seq_len]`` (``z_L`` None for the single-state
            ablation). ``z_H[-1]`` is ``solve(..., max_segments=segments).predictions``.
        freeze_state: the freeze setting the rollout ran under.
    """

    levels: list[str]
    segment: list[int]
    z_H: torch.Tensor
    z_L: torch.Tensor | None
    freeze_state: str | None = None


def rollout(model, input_ids, segments: int | None = None, freeze_state: str | None = None,
            puzzle_identifiers=None) -> Rollout:
    """Run ``segments`` segments (default ``halt_max_steps``) from fresh states and decode z_H and
    z_L after every sub-step. Labels play no part."""
    ids = _as_ids(model, input_ids)
    steps = list(model.config.sub_steps)
    levels, seg, zh, zl = [], [], [], []
    for s, _, trace in _segments(model, ids, segments, freeze_state, puzzle_identifiers, True,
                                 False):
        levels += steps
        seg += [s] * len(steps)
        zh += [t.argmax(-1).cpu() for t in trace["z_H_logits"]]
        zl += [t.argmax(-1).cpu() for t in trace["z_L_logits"]]
    return Rollout(levels=levels, segment=seg, z_H=torch.stack(zh),
                   z_L=torch.stack(zl) if zl else None, freeze_state=freeze_state)


# ---------------------------------------------------------------------------- decoded statistics
def content_change(tokens) -> torch.Tensor:
    """``[T-1, B]``: positions whose decoded token differs between sub-steps ``t`` and ``t+1``
    (any transition counts, to or from BLANK / PAD included), for ``tokens`` ``[T, B, seq_len]``."""
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 3:
        raise ValueError(f"tokens must be [sub_steps, batch, seq_len], got {tuple(tokens.shape)}")
    return (tokens[1:] != tokens[:-1]).sum(-1)


def undecided_fraction(tokens, undecided_token: int) -> torch.Tensor:
    """``[T, B]``: fraction of positions decoded as ``undecided_token`` (BLANK for Sudoku, PAD for
    Maze)."""
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 3:
        raise ValueError(f"tokens must be [sub_steps, batch, seq_len], got {tuple(tokens.shape)}")
    return (tokens == undecided_token).double().mean(-1)


def _curve_stats(tokens: torch.Tensor | None) -> dict | None:
    if tokens is None:
        return None
    change = content_change(tokens).double()  # [T-1, B]
    return {"total_mean": float(change.sum(0).mean()), "curve": change.mean(1).tolist()}


def freeze_experiment(model, input_ids, segments: int | None = None,
                      puzzle_identifiers=None) -> dict:
    """The paired freeze experiments of section 6.

    Returns ``{"levels": [...], "modes": {"normal" | "freeze_H" | "freeze_L": {"freeze_state",
    "z_H": {"total_mean", "curve"}, "z_L": {...} | None}}}``: ``total_mean`` is the mean over
    puzzles of the content change summed over all consecutive sub-step pairs, ``curve[t]`` the
    mean over puzzles of the change between sub-steps ``t`` and ``t+1``. The frozen state's
    change is zero by construction.
    """
    out = {"levels": None, "modes": {}}
    for name, state in (("normal", None), ("freeze_H", "H"), ("freeze_L", "L")):
        roll = rollout(model, input_ids, segments, state, puzzle_identifiers)
        out["levels"] = roll.levels
        out["modes"][name] = {"freeze_state": state, "z_H": _curve_stats(roll.z_H),
                              "z_L": _curve_stats(roll.z_L)}
    return out


# ---------------------------------------------------------------------------- neighbourhoods
def sudoku_neighbourhood(size: int) -> torch.Tensor:
    """``[n², n²]`` bool: ``N[q, k]`` when cell ``k ≠ q`` shares a row, column or box with ``q``
    (20 cells for 9×9, 7 for 4×4), boxes as in :class:`SudokuSpec`."""
    spec = SudokuSpec(size)
    idx = torch.arange(size * size)
    r, c = idx // size, idx % size
    b = (r // spec.box_rows) * (size // spec.box_cols) + c // spec.box_cols
    same = (r[:, None] == r[None]) | (c[:, None] == c[None]) | (b[:, None] == b[None])
    return same & ~torch.eye(size * size, dtype=torch.bool)


def violated_cells(tokens, size: int) -> torch.Tensor:
    """``[..., n²]`` bool: digit cells (token ≥ 2) whose digit also appears in another cell of
    their row, column or box. BLANK / PAD cells are never violated."""
    tokens = torch.as_tensor(tokens)
    nb = sudoku_neighbourhood(size).to(tokens.device)
    digit = tokens > BLANK
    clash = (tokens.unsqueeze(-1) == tokens.unsqueeze(-2)) & nb & digit.unsqueeze(-2)
    return clash.any(-1) & digit


def maze_neighbourhoods(size: int, window: int = 2) -> dict[str, torch.Tensor]:
    """``[n², n²]`` bool neighbourhoods of every cell (the cell itself excluded, clipped at the
    border): ``"n4"`` (cardinal), ``"n8"`` (king moves) and ``"window"`` (the
    ``(2·window+1)²`` square centred on the cell)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    idx = torch.arange(size * size)
    r, c = idx // size, idx % size
    dr, dc = (r[:, None] - r[None]).abs(), (c[:, None] - c[None]).abs()
    not_self = ~torch.eye(size * size, dtype=torch.bool)
    return {"n4": (dr + dc == 1), "n8": (torch.maximum(dr, dc) == 1),
            "window": (torch.maximum(dr, dc) <= window) & not_self}


# ---------------------------------------------------------------------------- attention stats
def _cell_start(model) -> int:
    """Index of the first cell in the block input (level token, then the state prefix)."""
    return int(model.config.level_token == "prepend_strip") + model.state_offset


def _cell_attention(model, maps: tuple[torch.Tensor, ...], seq_len: int) -> list[torch.Tensor]:
    """Per layer ``[B, heads, cells, cells]`` float64, renormalised over the cell keys."""
    start = _cell_start(model)
    out = []
    for a in maps:
        if a.shape[-1] != start + seq_len:
            raise RuntimeError(f"attention over {a.shape[-1]} positions, expected "
                               f"{start} + {seq_len}")
        a = a[:, :, start:, start:].double()
        out.append(a / a.sum(-1, keepdim=True))
    return out


def _mass(p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Head-mean attention mass on ``mask`` (``[S,S]``, ``[B,S,S]`` or key mask ``[B,1,S]``):
    ``[B, S]`` per query."""
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    return (p * mask.unsqueeze(1).to(p.dtype)).sum(-1).mean(1)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(p, p).sum(-1).mean(1)


def _density(mass: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    count = count.to(mass.dtype)
    return torch.where(count > 0, mass / count.clamp_min(1), torch.nan)


def _locality_values(model, input_ids, segments, puzzle_identifiers, batch_size, queries_of,
                     stats_of) -> dict[str, np.ndarray]:
    """Shared driver: per chunk and segment, take the first L- and first H-update's attention,
    compute per-query ``stats_of(p_L, p_H, z_H tokens, rows)`` per layer for the queries
    ``queries_of(rows)`` (``[b, S]`` bool), and stack them ``[n_queries, layers]``."""
    ids = _as_ids(model, input_ids)
    steps = list(model.config.sub_steps)
    first_L, first_H = steps.index("L"), steps.index("H")
    seq_len = model.config.seq_len
    columns: dict[str, list] = {"segment": [], "row": [], "cell": []}
    stats: dict[str, list] = {}
    for lo in range(0, ids.shape[0], batch_size):
        rows = slice(lo, lo + batch_size)
        pids = None if puzzle_identifiers is None else torch.as_tensor(puzzle_identifiers)[rows]
        query = queries_of(rows).to(ids.device)
        where = query.nonzero()
        for s, z_H_in, trace in _segments(model, ids[rows], segments, None, pids, False, True):
            tokens = model.decode(z_H_in).argmax(-1)
            maps_L = _cell_attention(model, trace["attentions"][first_L], seq_len)
            maps_H = _cell_attention(model, trace["attentions"][first_H], seq_len)
            per_layer: dict[str, list] = {}
            for p_L, p_H in zip(maps_L, maps_H, strict=True):
                for name, value in stats_of(p_L, p_H, tokens, rows).items():
                    per_layer.setdefault(name, []).append(value[query].cpu())
            for name, values in per_layer.items():
                stats.setdefault(name, []).append(torch.stack(values, -1))
            columns["segment"].append(torch.full((len(where),), s))
            columns["row"].append(where[:, 0].cpu() + lo)
            columns["cell"].append(where[:, 1].cpu())
    out = {k: torch.cat(v).numpy() for k, v in columns.items()}
    out.update({k: torch.cat(v).numpy() for k, v in stats.items()})
    return out


def sudoku_locality_values(model, input_ids, size: int, segments: int | None = None,
                           puzzle_identifiers=None, batch_size: int = 16) -> dict[str, np.ndarray]:
    """Per-query Sudoku statistics (appendix E) for every blank input cell and segment.

    Returns arrays over queries (ordered by chunk of ``batch_size`` rows, segment, row, cell):
    ``segment``, ``row``, ``cell``, ``violation_adjacent`` (bool), and ``[n_queries, layers]``:
    ``delta_N`` (mass_L − mass_H inside N(q)), ``delta_ent`` (Ent_H − Ent_L over the cell keys),
    ``delta_V`` (mass_L − mass_H on violated cells) and ``delta_V_within`` (inside N(q): the L−H
    per-cell density on violated cells minus that on non-violated cells; NaN unless N(q) holds
    both kinds).
    """
    if model.config.seq_len != size * size:
        raise ValueError(f"model seq_len {model.config.seq_len} does not fit a {size}×{size} board")
    ids = _as_ids(model, input_ids)
    nb = sudoku_neighbourhood(size).to(ids.device)

    def stats_of(p_L, p_H, tokens, rows):
        viol = violated_cells(tokens, size)  # [b, S] keys
        in_v = nb.unsqueeze(0) & viol.unsqueeze(1)  # [b, S, S]
        out_v = nb.unsqueeze(0) & ~viol.unsqueeze(1)
        dens = {}
        for name, mask in (("v", in_v), ("o", out_v)):
            count = mask.sum(-1)
            dens[name] = (_density(_mass(p_L, mask), count) - _density(_mass(p_H, mask), count))
        key_v = viol.unsqueeze(1)
        return {"delta_N": _mass(p_L, nb) - _mass(p_H, nb),
                "delta_ent": _entropy(p_H) - _entropy(p_L),
                "delta_V": _mass(p_L, key_v) - _mass(p_H, key_v),
                "delta_V_within": dens["v"] - dens["o"],
                "violation_adjacent": in_v.any(-1).double().expand(p_L.shape[0], -1)}

    values = _locality_values(model, ids, segments, puzzle_identifiers, batch_size,
                              lambda rows: ids[rows] == BLANK, stats_of)
    values["violation_adjacent"] = values["violation_adjacent"][:, 0] > 0
    return values


def maze_locality_values(model, input_ids, labels, size: int, segments: int | None = None,
                         window: int = 2, puzzle_identifiers=None,
                         batch_size: int = 16) -> dict[str, np.ndarray]:
    """Per-query Maze statistics (appendix F) for every solution-path cell (``labels == PATH``).

    Returns ``segment``, ``row``, ``cell``, ``error_adjacent`` (the window holds a cell whose
    decoded z_H differs from the label) and ``[n_queries, layers]``: ``delta_density_n4``,
    ``delta_density_n8``, ``delta_density_window`` (``(mass_L − mass_H) / |N|`` with ``|N|``
    the cells of the neighbourhood inside the grid), ``delta_ent`` (Ent_H − Ent_L over all cells),
    ``delta_V`` (mass_L − mass_H on wrong cells) and ``delta_V_within`` (as for Sudoku, inside
    the window).
    """
    if model.config.seq_len != size * size:
        raise ValueError(f"model seq_len {model.config.seq_len} does not fit a {size}×{size} maze")
    ids = _as_ids(model, input_ids)
    labels = _as_ids(model, labels)
    if labels.shape != ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not match inputs {tuple(ids.shape)}")
    hoods = {k: v.to(ids.device) for k, v in maze_neighbourhoods(size, window).items()}

    def stats_of(p_L, p_H, tokens, rows):
        wrong = tokens != labels[rows]
        win = hoods["window"]
        in_v = win.unsqueeze(0) & wrong.unsqueeze(1)
        out_v = win.unsqueeze(0) & ~wrong.unsqueeze(1)
        out = {}
        for name, mask in hoods.items():
            out[f"delta_density_{name}"] = _density(_mass(p_L, mask) - _mass(p_H, mask),
                                                    mask.sum(-1)).expand(p_L.shape[0], -1)
        out["delta_ent"] = _entropy(p_H) - _entropy(p_L)
        key_v = wrong.unsqueeze(1)
        out["delta_V"] = _mass(p_L, key_v) - _mass(p_H, key_v)
        dens = {}
        for name, mask in (("v", in_v), ("o", out_v)):
            count = mask.sum(-1)
            dens[name] = (_density(_mass(p_L, mask), count) - _density(_mass(p_H, mask), count))
        out["delta_V_within"] = dens["v"] - dens["o"]
        out["error_adjacent"] = in_v.any(-1).double().expand(p_L.shape[0], -1)
        return out

    values = _locality_values(model, ids, segments, puzzle_identifiers, batch_size,
                              lambda rows: labels[rows] == PATH, stats_of)
    values["error_adjacent"] = values["error_adjacent"][:, 0] > 0
    return values


def _mean_ci(x: np.ndarray) -> dict:
    """Per-layer mean and 95% half-width over queries (NaNs dropped), ``x`` ``[n, layers]``."""
    means, cis, ns = [], [], []
    for column in x.T:
        column = column[~np.isnan(column)]
        n = len(column)
        means.append(float(column.mean()) if n else math.nan)
        cis.append(float(Z * column.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan)
        ns.append(n)
    return {"mean": means, "ci95": cis, "n": ns}


def summarise(values: dict[str, np.ndarray], class_key: str, class_names: tuple[str, str],
              stats: list[str]) -> dict:
    """``{"queries": {class: n}, "stats": {stat: {class: {"mean", "ci95", "n"}}}}`` with classes
    ``"all"``, ``class_names[0]`` (``values[class_key]`` true) and ``class_names[1]``."""
    flag = values[class_key]
    classes = {"all": np.ones_like(flag), class_names[0]: flag, class_names[1]: ~flag}
    return {
        "queries": {c: int(m.sum()) for c, m in classes.items()},
        "stats": {s: {c: _mean_ci(values[s][m]) for c, m in classes.items()} for s in stats},
    }


def sudoku_attention_locality(model, input_ids, size: int, segments: int | None = None,
                              puzzle_identifiers=None, batch_size: int = 16) -> dict:
    """Section-7 Sudoku contrasts per layer with 95% CIs (see :func:`sudoku_locality_values`):
    ``{"task": "sudoku", "num_layers", "segments", "queries": {...}, "stats": {"delta_N" |
    "delta_ent" | "delta_V" | "delta_V_within": {"all" | "violation_adjacent" | "control":
    {"mean": [per layer], "ci95": [...], "n": [...]}}}}``."""
    values = sudoku_locality_values(model, input_ids, size, segments, puzzle_identifiers,
                                    batch_size)
    out = {"task": "sudoku", "num_layers": model.config.num_hidden_layers,
           "segments": segments or model.config.halt_max_steps}
    out.update(summarise(values, "violation_adjacent", ("violation_adjacent", "control"),
                         ["delta_N", "delta_ent", "delta_V", "delta_V_within"]))
    return out


def maze_attention_locality(model, input_ids, labels, size: int, segments: int | None = None,
                            window: int = 2, puzzle_identifiers=None,
                            batch_size: int = 16) -> dict:
    """Section-7 Maze contrasts per layer with 95% CIs (see :func:`maze_locality_values`), in the
    layout of :func:`sudoku_attention_locality` with classes ``error_adjacent`` / ``control``."""
    values = maze_locality_values(model, input_ids, labels, size, segments, window,
                                  puzzle_identifiers, batch_size)
    out = {"task": "maze", "num_layers": model.config.num_hidden_layers,
           "segments": segments or model.config.halt_max_steps, "window": window}
    out.update(summarise(values, "error_adjacent", ("error_adjacent", "control"),
                         ["delta_density_n4", "delta_density_n8", "delta_density_window",
                          "delta_ent", "delta_V", "delta_V_within"]))
    return out
