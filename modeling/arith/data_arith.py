"""The assign-and-add task: sequences, held-out addition pairs, restricted variable positions.

A sequence has ``T = prefix + 4`` tokens: a ``prefix``-token block (12 by default) holding 1-6
contiguous ``var value`` assignments in random order with ``PAD`` tokens scattered into the gaps,
then ``+ lhs rhs =``. Operands are numbers or assigned variables; the label is
``(value(lhs) + value(rhs)) mod N``. Types: 0-var (the assignments are distractors), 1-var (the
variable on the left or on the right), 2-var (two distinct variables).

Training excludes (i) the held-out ordered addition pairs ``(value(lhs), value(rhs))`` in every
form and (ii) variables in restricted operand positions. The defaults are the authors' code: the
training mix ``0-var : 1-var : 2-var = 12 : 20 : 10`` and the held-out pairs of
``random.Random(42).sample(P, int(0.7 * N * N))`` over the row-major pair list ``P`` (the pairs
not sampled are held out: 1,045 of 3,481 at ``N = 59``). Default restriction (consistent with
the paper's section 6 and appendix A, which contradict its section 3): the first two variables
(``a``, ``b``) never as the right operand, the last two (``k``, ``l``) never as the left.

Everything is vectorised in torch and driven by a ``torch.Generator``, so a seed reproduces a
stream exactly; :func:`arith_dataset` wraps a draw as a ``datasets.Dataset``.
"""

from __future__ import annotations

import random
import string
from dataclasses import asdict, dataclass

import torch

try:
    import datasets
except ImportError:  # pragma: no cover - datasets is a dependency of the package
    datasets = None

__all__ = [
    "POOLS",
    "CURATED_POOLS",
    "SPLITS",
    "ArithTask",
    "PoolSpec",
    "arith_dataset",
    "decode",
    "sample_batch",
]


SPLITS = {"authors": 42, "torch": 0}
"""Held-out pair recipes of :class:`ArithTask` and the seed each uses by default."""


@dataclass(frozen=True)
class ArithTask:
    """The data distribution.

    Args:
        modulus: ``N`` (59).
        num_variables: ``V`` (12).
        seq_len: ``T`` (16); the assignment prefix has ``T - 4`` tokens.
        min_assignments / max_assignments: assignments per prefix (1 and ``(T - 4) // 2``).
        held_out_fraction: fraction of the ``N^2`` ordered pairs never trained on (0.3).
        one_var_ratio: frequency of 1-var relative to 0-var sequences in training (20 / 12, the
            authors' mix ``12 : 20 : 10``).
        two_var_ratio: ``r``, frequency of 2-var relative to 0-var sequences (10 / 12).
        no_lhs_variables: variable indices never the left operand in training; default the
            last ``min(2, (V - 1) // 2)`` (``k``, ``l``).
        no_rhs_variables: variable indices never the right operand in training; default the
            first ``min(2, (V - 1) // 2)`` (``a``, ``b``).
        held_out_split: how the held-out pairs are drawn. ``"authors"``: the authors' code,
            ``random.Random(split_seed).sample(P, int((1 - held_out_fraction) * N * N))`` over
            ``P = [(a, b) for a in range(N) for b in range(N)]`` picks the *training* pairs;
            ``"torch"``: our first version, the first ``round(held_out_fraction * N * N)`` of a
            ``torch.randperm`` are held out.
        split_seed: seed of the held-out pair choice; None = 42 for ``"authors"`` (their seed),
            0 for ``"torch"`` (our first version's).
    """

    modulus: int = 59
    num_variables: int = 12
    seq_len: int = 16
    min_assignments: int = 1
    max_assignments: int | None = None
    held_out_fraction: float = 0.3
    one_var_ratio: float = 20 / 12
    two_var_ratio: float = 10 / 12
    no_lhs_variables: tuple[int, ...] | None = None
    no_rhs_variables: tuple[int, ...] | None = None
    held_out_split: str = "authors"
    split_seed: int | None = None

    def __post_init__(self) -> None:
        count = max(0, min(2, (self.num_variables - 1) // 2))
        if self.no_lhs_variables is None:
            object.__setattr__(self, "no_lhs_variables",
                               tuple(range(self.num_variables - count, self.num_variables)))
        if self.no_rhs_variables is None:
            object.__setattr__(self, "no_rhs_variables", tuple(range(count)))
        object.__setattr__(self, "no_lhs_variables", tuple(self.no_lhs_variables))
        object.__setattr__(self, "no_rhs_variables", tuple(self.no_rhs_variables))
        if self.held_out_split not in SPLITS:
            raise ValueError(f"ArithTask.held_out_split must be one of {', '.join(SPLITS)}, "
                             f"got {self.held_out_split!r}")
        if self.split_seed is None:
            object.__setattr__(self, "split_seed", SPLITS[self.held_out_split])
        prefix = self.seq_len - 4
        if self.modulus < 2:
            raise ValueError(f"ArithTask.modulus must be >= 2, got {self.modulus}")
        if self.num_variables < 2:
            raise ValueError(f"ArithTask.num_variables must be >= 2, got {self.num_variables}")
        if prefix < 2:
            raise ValueError(f"ArithTask.seq_len must be >= 6, got {self.seq_len}")
        if self.max_assignments is None:
            object.__setattr__(self, "max_assignments", min(prefix // 2, self.num_variables))
        if not 2 <= self.max_assignments * 2 <= prefix or self.max_assignments > self.num_variables:
            raise ValueError(
                f"ArithTask.max_assignments must be in [1, min((seq_len - 4) // 2, num_variables)]"
                f" with room for 2-var sequences, got {self.max_assignments}"
            )
        if not 1 <= self.min_assignments <= self.max_assignments:
            raise ValueError(
                f"ArithTask.min_assignments must be in [1, max_assignments], "
                f"got {self.min_assignments}"
            )
        if self.max_assignments < 2:
            raise ValueError("ArithTask.max_assignments must be >= 2 for 2-var sequences")
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ValueError(
                f"ArithTask.held_out_fraction must be in [0, 1), got {self.held_out_fraction}"
            )
        for name in ("one_var_ratio", "two_var_ratio"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"ArithTask.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("no_lhs_variables", "no_rhs_variables"):
            bad = [v for v in getattr(self, name) if not 0 <= v < self.num_variables]
            if bad:
                raise ValueError(f"ArithTask.{name} has indices outside [0, V): {bad}")
            if len(set(getattr(self, name))) >= self.num_variables:
                raise ValueError(f"ArithTask.{name} restricts every variable")

    @property
    def prefix_len(self) -> int:
        return self.seq_len - 4

    @property
    def plus_id(self) -> int:
        return self.modulus

    @property
    def equals_id(self) -> int:
        return self.modulus + 1

    @property
    def pad_id(self) -> int:
        return self.modulus + 2

    @property
    def var_offset(self) -> int:
        return self.modulus + 3

    @property
    def vocab_size(self) -> int:
        return self.modulus + 3 + self.num_variables

    def held_out_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, True for the held-out ordered pairs ``(lhs value, rhs value)``."""
        n = self.modulus
        if self.held_out_split == "authors":
            pairs = [(a, b) for a in range(n) for b in range(n)]
            trained = random.Random(self.split_seed).sample(
                pairs, int((1 - self.held_out_fraction) * n * n))
            mask = torch.ones(n, n, dtype=torch.bool)
            mask[tuple(torch.tensor(trained, dtype=torch.long).reshape(-1, 2).T)] = False
            return mask
        count = round(self.held_out_fraction * n * n)
        gen = torch.Generator().manual_seed(self.split_seed)
        order = torch.randperm(n * n, generator=gen)
        mask = torch.zeros(n * n, dtype=torch.bool)
        mask[order[:count]] = True
        return mask.view(n, n)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PoolSpec:
    """One evaluation pool: the operand types, the pair set and the variable-position policy.

    ``num_vars``: tuple of operand-variable counts mixed equally. ``pairs``: ``"train"`` or
    ``"held_out"``. ``bad_positions``: how many operand variables sit in a restricted position
    (0, 1, 2, or -1 for "at least one").
    """

    num_vars: tuple[int, ...]
    pairs: str = "train"
    bad_positions: int = 0


POOLS: dict[str, PoolSpec] = {
    "0var/train": PoolSpec((0,)),
    "0var/add_restricted": PoolSpec((0,), "held_out"),
    "1var/train": PoolSpec((1,)),
    "1var/add_restricted": PoolSpec((1,), "held_out"),
    "1var/var_restricted": PoolSpec((1,), "train", 1),
    "2var/train": PoolSpec((2,)),
    "2var/add_restricted": PoolSpec((2,), "held_out"),
    "2var/var_restricted(1)": PoolSpec((2,), "train", 1),
    "2var/var_restricted(2)": PoolSpec((2,), "train", 2),
}
"""The split pools of the paper's figure 2: type x (train / held-out pairs / bad positions)."""

CURATED_POOLS: dict[str, PoolSpec] = {
    "novel_positions": PoolSpec((1, 2), "train", -1),
    "held_out_pairs": PoolSpec((0, 1, 2), "held_out"),
}
"""The curated sets of section 4: novel variable positions (99.6%) and held-out pairs (99.4%)."""


def _pick(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Uniform choice per row among ``allowed [B, V]`` using i.i.d. ``scores [B, V]``."""
    return scores.masked_fill(~allowed, -1.0).argmax(dim=1)


def _operand_variables(
    task: ArithTask, num_vars: torch.Tensor, bad: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left / right operand variable per row (``-1`` = a number) -> two ``[B]`` long tensors.

    ``bad [B]`` is the number of operand variables that must sit in a restricted position
    (0 = all allowed, 1 = exactly one, 2 = both, -1 = at least one).
    """
    b, v = num_vars.shape[0], task.num_variables
    no_lhs = torch.zeros(v, dtype=torch.bool)
    no_lhs[list(task.no_lhs_variables)] = True
    no_rhs = torch.zeros(v, dtype=torch.bool)
    no_rhs[list(task.no_rhs_variables)] = True
    # Which operand slots hold a variable: 1-var picks a side at random.
    left_side = torch.rand(b, generator=gen) < 0.5
    has_l = (num_vars == 2) | ((num_vars == 1) & left_side)
    has_r = (num_vars == 2) | ((num_vars == 1) & ~left_side)
    # Which variable slots must be in a bad position.
    want_bad = bad.clone()
    at_least_one = want_bad < 0
    two_var_any = at_least_one & (num_vars == 2)
    # "At least one" on 2-var: one or both bad with equal weight over the feasible outcomes.
    want_bad = torch.where(at_least_one, torch.ones_like(want_bad), want_bad)
    both = two_var_any & (torch.rand(b, generator=gen) < 1 / 3)
    want_bad = torch.where(both, torch.full_like(want_bad, 2), want_bad)
    bad_l = has_l & ((want_bad == 2) | ((want_bad == 1) & (~has_r | left_side)))
    bad_r = has_r & ((want_bad == 2) | ((want_bad == 1) & (~has_l | ~left_side)))
    allowed_l = torch.where(bad_l[:, None], no_lhs[None], ~no_lhs[None])
    allowed_r = torch.where(bad_r[:, None], no_rhs[None], ~no_rhs[None])
    lhs = _pick(torch.rand(b, v, generator=gen), allowed_l)
    allowed_r = allowed_r & (torch.arange(v)[None] != torch.where(has_l, lhs, -1)[:, None])
    rhs = _pick(torch.rand(b, v, generator=gen), allowed_r)
    return torch.where(has_l, lhs, -1), torch.where(has_r, rhs, -1)


def sample_batch(
    task: ArithTask,
    batch_size: int,
    gen: torch.Generator,
    *,
    num_vars: tuple[int, ...] | torch.Tensor | None = None,
    pairs: str = "train",
    bad_positions: int = 0,
    held_out: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Draw ``batch_size`` sequences.

    Args:
        num_vars: operand-variable counts mixed equally, or a ``[B]`` tensor; None = the
            training mix ``1 : one_var_ratio : two_var_ratio``.
        pairs: ``"train"`` (pairs not held out) or ``"held_out"``.
        bad_positions: see :class:`PoolSpec`; 0 is the training policy.
        held_out: ``task.held_out_mask()``, passed in to avoid recomputing it.

    Returns:
        ``input_ids [B, T]``, ``labels [B]``, ``num_vars [B]``, ``lhs [B]`` / ``rhs [B]`` (operand
        values), ``lhs_var [B]`` / ``rhs_var [B]`` (variable index or -1), ``lhs_src [B]`` /
        ``rhs_src [B]`` (position of the operand's value: the assignment's number, or the operand
        slot itself for a number).
    """
    n, v, p = task.modulus, task.num_variables, task.prefix_len
    b = batch_size
    if held_out is None:
        held_out = task.held_out_mask()
    if isinstance(num_vars, torch.Tensor):
        nv = num_vars.long()
    else:
        if num_vars is None:
            weights = torch.tensor([1.0, task.one_var_ratio, task.two_var_ratio])
        else:
            weights = torch.zeros(3)
            weights[list(num_vars)] = 1.0
        nv = torch.multinomial(weights, b, replacement=True, generator=gen)
    flat = held_out.flatten()
    candidates = (flat if pairs == "held_out" else ~flat).nonzero().squeeze(1)
    if pairs not in ("train", "held_out") or candidates.numel() == 0:
        raise ValueError(f"pairs must be 'train' or 'held_out' with a non-empty set, got {pairs!r}")
    if bad_positions != 0 and not (task.no_lhs_variables and task.no_rhs_variables):
        raise ValueError("bad_positions needs restricted variables on both operand sides")
    pair = candidates[torch.randint(candidates.numel(), (b,), generator=gen)]
    lhs, rhs = pair // n, pair % n
    bad = torch.full((b,), bad_positions, dtype=torch.long)
    lhs_var, rhs_var = _operand_variables(task, nv, bad, gen)

    # Assigned variables: operands first, then distractors, k of them in all.
    k_min = torch.clamp(nv, min=task.min_assignments)
    span = task.max_assignments - k_min + 1
    k = k_min + (torch.rand(b, generator=gen) * span).long()
    key = torch.rand(b, v, generator=gen)
    rows = torch.arange(b)
    for var in (lhs_var, rhs_var):
        key[rows[var >= 0], var[var >= 0]] = -1.0
    assigned = key.argsort(dim=1)  # [B, V]: operand variables first
    values = torch.randint(n, (b, v), generator=gen)
    values[rows[lhs_var >= 0], lhs_var[lhs_var >= 0]] = lhs[lhs_var >= 0]
    values[rows[rhs_var >= 0], rhs_var[rhs_var >= 0]] = rhs[rhs_var >= 0]

    # Layout: k assignment units and p - 2k PAD units in a uniformly random order.
    units = p - k  # [B]
    unit_key = torch.rand(b, p, generator=gen)
    unit_key[torch.arange(p)[None] >= units[:, None]] = 2.0
    order = unit_key.argsort(dim=1)  # unit ids; ids < k are assignments (in assigned order)
    ids = torch.full((b, task.seq_len), task.pad_id, dtype=torch.long)
    src = torch.full((b, v), -1, dtype=torch.long)  # position of each variable's value
    pos = torch.zeros(b, dtype=torch.long)
    for slot in range(p):
        unit = order[:, slot]
        live = slot < units
        is_assign = live & (unit < k)
        var = assigned[rows, unit.clamp(max=v - 1)]
        a = rows[is_assign]
        ids[a, pos[a]] = task.var_offset + var[a]
        ids[a, pos[a] + 1] = values[a, var[a]]
        src[a, var[a]] = pos[a] + 1
        pos = pos + live.long() + is_assign.long()
    ids[:, p] = task.plus_id
    ids[:, p + 1] = torch.where(lhs_var >= 0, task.var_offset + lhs_var, lhs)
    ids[:, p + 2] = torch.where(rhs_var >= 0, task.var_offset + rhs_var, rhs)
    ids[:, p + 3] = task.equals_id
    lhs_src = torch.where(lhs_var >= 0, src[rows, lhs_var.clamp(min=0)], p + 1)
    rhs_src = torch.where(rhs_var >= 0, src[rows, rhs_var.clamp(min=0)], p + 2)
    return {
        "input_ids": ids,
        "labels": (lhs + rhs) % n,
        "num_vars": nv,
        "lhs": lhs,
        "rhs": rhs,
        "lhs_var": lhs_var,
        "rhs_var": rhs_var,
        "lhs_src": lhs_src,
        "rhs_src": rhs_src,
    }


def sample_pool(
    task: ArithTask, spec: PoolSpec, size: int, seed: int, held_out: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """A fixed evaluation pool of ``size`` sequences drawn from ``spec`` with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    nv = torch.tensor(spec.num_vars)[torch.randint(len(spec.num_vars), (size,), generator=gen)]
    return sample_batch(task, size, gen, num_vars=nv, pairs=spec.pairs,
                        bad_positions=spec.bad_positions, held_out=held_out)


def decode(task: ArithTask, ids: torch.Tensor | list[int]) -> str:
    """Readable text of one sequence, e.g. ``"PAD c 1 PAD f 17 a 42 PAD + f 19 ="``."""
    names = [str(i) for i in range(task.modulus)] + ["+", "=", "PAD"]
    names += [_var_name(i) for i in range(task.num_variables)]
    return " ".join(names[int(i)] for i in ids)


def _var_name(i: int) -> str:
    letters = string.ascii_lowercase
    return letters[i] if i < len(letters) else f"v{i}"


def arith_dataset(
    task: ArithTask,
    num_examples: int,
    seed: int,
    pool: str | None = None,
) -> datasets.Dataset:
    """A ``datasets.Dataset`` of ``num_examples`` sequences from the training distribution, or
    from one of :data:`POOLS` / :data:`CURATED_POOLS` when ``pool`` names one.

    Columns: ``input_ids``, ``labels``, ``num_vars``, ``lhs``, ``rhs``, ``lhs_var``, ``rhs_var``,
    ``lhs_src``, ``rhs_src``, and ``text`` (decoded tokens).
    """
    if datasets is None:
        raise ImportError("arith_dataset needs the `datasets` package: pip install datasets")
    specs = {**POOLS, **CURATED_POOLS}
    if pool is None:
        batch = sample_batch(task, num_examples, torch.Generator().manual_seed(seed))
    elif pool in specs:
        batch = sample_pool(task, specs[pool], num_examples, seed)
    else:
        raise ValueError(f"unknown pool {pool!r}; choose one of {sorted(specs)}")
    columns = {name: value.tolist() for name, value in batch.items()}
    columns["text"] = [decode(task, row) for row in batch["input_ids"]]
    return datasets.Dataset.from_dict(columns)
