"""Site search under a cost budget: the most target movement that keeps the model intact.

The behavioural search of :mod:`hf_memory.selection.behavioural_search` ranks configurations by how
far they
move the calibration pairs; on a 135M model the largest movements come from sites where any bank
breaks the model (a broken model is also less cheerful). This search scores every configuration
(layers, then units inside them) *at the strongest dial setting its cost allows*:

    cost(S, s)  = ΔNLL per token of neutral text with the banks at sites S, strength s
    s*(S)       = the largest setting of the dial with cost(S, s) <= budget (0: none fits)
    target(S)   = mean over target pairs of [shift(banks at S, s*) − shift(neutral bank at S, s*)]
    score(S)    = target − uncertainty_weight·se − drift_weight·drift − cost_weight·cost

The dial is an ordered grid of settings (strength, layer gain ρ): the strengths at the base
gain ρ₀ (1 by default), then, where ``gains`` are given, full strength at each larger ρ (ρ
multiplies every bank gain: a bias ρλ on the bank's slot logits, eq. 9), so a bank that costs
little at full strength can be pushed past it. s* is found by bisection on the grid, which
assumes the cost grows along it (it does on every curve measured; see BENCHMARKS.md); every
chosen setting is measured within budget. The bisection starts from what configurations
already searched say, assuming the cost also grows with the sites steered: a configuration's
setting is at most that of any searched configuration it contains, and at least that of any it
is contained in (a bound checked by one probe before it is trusted).
Subtracting the neutral bank's movement at the same sites and strength scores content, not
presence. Taking the strongest setting within budget is the budget rule: the most target
movement the budget buys (movement grows with the strength on every measured curve; a user who
wants less turns ``steer(..., strength=)`` down from there). Stages, each keeping a change only
when the score improves:

1. every candidate layer alone (all units; or every k-th with ``layer_stride``);
2. greedy addition of the next best layers of stage 1 (``top_layers`` trials at most);
3. greedy removal of units (KV groups of grouped-query models, else query heads) one at a time.

Two more ceilings, each optional, make a configuration unfit whatever it moves:

- ``kv_ceiling``: bytes of bank keys and values a configuration may carry (every bank's slots at
  the steered KV heads of every steered layer; :meth:`BudgetSearch.kv_bytes`). The search only
  scores configurations within it: stages 1 and 2 take, at a layer whose whole bank would go
  over it, the most KV groups (or heads) that fit, in order, so the search still reaches the
  layer.
- ``capability`` with ``capability_ceiling``: nats per answer the steering may cost on held-out
  factual answers (:class:`~hf_memory.metrics.factual.AnswerCost`); a dial setting is
  within budget only when it is within both the neutral-text budget and this ceiling.

Banks in concatenated attention (``prompt_like``) at every layer are the visible prompt, which
the greedy stages (at most ``top_layers`` layers) cannot reach; :meth:`BudgetSearch.every_layer`
scores it as one more candidate, less the layers where a bank alone breaks the budget (on the
embedded model layer 1, whose first token, the attention sink, sees slots placed before it where
it would not see a visible prompt, and loses its massive activation).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from hf_memory.banks.bank_set import BankSet
from hf_memory.baselines.methods import MemoryMethod
from hf_memory.selection.behavioural_search import (
    DEFAULT_COST_BUDGET,
    ShiftObjective,
    SiteScore,
    check_weight,
)
from hf_memory.selection.probe_threads import check_workers, map_in_threads

__all__ = ["DEFAULT_COST_BUDGET", "DEFAULT_STRENGTHS", "PROMPT_LIKE_GAINS", "BudgetSearch",
           "DialProbes"]

DEFAULT_STRENGTHS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
# ρ above full strength for banks in concatenated attention (no size normalisation): measured on
# the embedded model, positioned descriptor banks at every third layer from 12 move held-out
# pairs +2.0 nats at ρ 0 (cost 0.03), +3.8 at ρ 1 (0.08), +5.7 at ρ 2 (0.18). Up to 16: on three
# user personas the exemplar banks stopped at the grid's top (ρ 6) at costs of 0.035-0.073,
# well inside the 0.1 budget (BENCHMARKS.md, "A user's own persona")
PROMPT_LIKE_GAINS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)

Units = dict[int, tuple[int, ...]]


@dataclass
class DialProbes:
    """What searches of one bank set have measured on the dial: the neutral-text and
    capability costs by (sites, setting), the strongest setting found by sites, and the
    objective's scores by (objective, sites, setting). Searches that share it (a screen, then
    the full search of the banks it kept) measure nothing twice; it refuses a search of other
    banks, costs, ceilings or dial (ValueError).

    ``recipe_control``: the neutral control built from the banks' recipe, made once for every
    search that shares these probes; scores are shared only between searches netted against
    it (or against no control). ``objectives``: the objectives built so far (their plain
    passes) by their key, the model, tokenizer and cost they measure with; a dict the probes of
    other banks may share (a persona's recipes scored on the same pairs), since an objective
    does not depend on the banks."""

    costs: dict[tuple, float] = field(default_factory=dict)
    capability: dict[tuple, float] = field(default_factory=dict)
    strongest: dict[tuple, int] = field(default_factory=dict)
    scores: dict[tuple, dict[str, float]] = field(default_factory=dict)
    objectives: dict[tuple, ShiftObjective] = field(default_factory=dict)
    recipe_control: BankSet | None = None
    measured_for: tuple | None = None

    def bind(self, search: BudgetSearch) -> None:
        """Tie these probes to ``search``'s banks, costs, ceilings and dial, or check that
        they are the ones they were measured for."""
        key = (id(search.banks), id(search.objective.cost), id(search.capability),
               search.cost_budget, search.capability_ceiling, tuple(search.settings))
        if self.measured_for is None:
            self.measured_for = key
        elif self.measured_for != key:
            raise ValueError("these dial probes were measured for other banks, costs, "
                             "ceilings or dial settings: give this search its own")


@dataclass
class BudgetSearch:
    """One search (module docstring) of ``banks`` against ``objective`` (which must carry a
    cost); ``control``: the neutral bank set whose movement at the same sites is subtracted
    (None: raw movement); ``progress_bar``: a tqdm bar of a longer job that every scored
    configuration advances (None: :meth:`run` shows its own); ``workers``: threads that
    measure independent configurations side by side (:meth:`score_each`; None:
    :data:`~hf_memory.selection.probe_threads.DEFAULT_WORKERS`, 1: one after the other)."""

    objective: ShiftObjective
    banks: BankSet
    cost_budget: float
    unit_type: str
    num_units: int
    control: BankSet | None = None
    strengths: Sequence[float] = DEFAULT_STRENGTHS
    base_gain: float = 1.0
    gains: Sequence[float] = ()
    kv_ceiling: int | None = None
    capability: Any = None
    capability_ceiling: float | None = None
    progress_bar: Any = None
    probes: DialProbes | None = None
    workers: int | None = None
    history: list[SiteScore] = field(default_factory=list)
    cost_probes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def __post_init__(self) -> None:
        check_weight("cost_budget", self.cost_budget)
        self.workers = check_workers(self.workers)
        if self.objective.cost is None:
            raise ValueError("a cost budget needs an objective with a cost (NeutralCost)")
        grid = sorted({float(s) for s in self.strengths})
        if not grid or grid[0] <= 0 or grid[-1] > 1:
            raise ValueError(f"strengths must be in (0, 1], got {list(self.strengths)}")
        self.strengths = grid
        check_weight("base_gain", self.base_gain)
        for gain in self.gains:
            check_weight("gains", gain)
        self.settings = ([(s, float(self.base_gain)) for s in grid]
                         + [(1.0, float(g)) for g in sorted(set(self.gains))
                            if g > self.base_gain])
        if self.kv_ceiling is not None and (isinstance(self.kv_ceiling, bool) or not isinstance(
                self.kv_ceiling, int) or self.kv_ceiling < 0):
            raise ValueError(f"kv_ceiling must be a number of bytes (an int >= 0) or None, got "
                             f"{self.kv_ceiling!r}")
        if (self.capability is None) != (self.capability_ceiling is None):
            raise ValueError("capability and capability_ceiling go together: give both or "
                             "neither")
        if self.capability_ceiling is not None and not (
                isinstance(self.capability_ceiling, int | float)
                and not isinstance(self.capability_ceiling, bool)
                and math.isfinite(self.capability_ceiling)):
            raise ValueError("capability_ceiling must be a finite number of nats per answer, "
                             f"got {self.capability_ceiling!r}")
        if self.probes is None:
            self.probes = DialProbes()
        self.probes.bind(self)
        self._costs, self._capability = self.probes.costs, self.probes.capability
        self._strongest = self.probes.strongest
        # query heads per KV head, where the units are query heads
        self._group = max(1, self.num_units // next(iter(self.banks)).num_kv_heads)
        # bytes of one KV head's slots at one layer, over every bank
        self._slot_bytes = self.banks.head_bytes()

    def kv_bytes(self, units: Units) -> int:
        """Bytes of bank keys and values the configuration steers with: every bank's slots at
        each steered KV head (a KV group is one; query heads count the KV heads they read) of
        each steered layer."""
        if self.unit_type == "kv_group":
            heads = sum(len(set(u)) for u in units.values())
        else:
            heads = sum(len({head // self._group for head in u}) for u in units.values())
        return heads * self._slot_bytes

    def fits(self, units: Units) -> bool:
        """Whether ``units`` is within the KV ceiling (always, without one)."""
        return self.kv_ceiling is None or self.kv_bytes(units) <= self.kv_ceiling

    def fitting(self, layer: int, beside: Units | None = None) -> tuple[int, ...]:
        """The most units of ``layer``, in order, that fit the KV ceiling beside ``beside``
        (all of them without a ceiling; none when even one is over it)."""
        every = tuple(range(self.num_units))
        for count in range(len(every), 0, -1):
            if self.fits({**(beside or {}), layer: every[:count]}):
                return every[:count]
        return ()

    def _method(self, banks: BankSet, units: Units, index: int) -> MemoryMethod:
        strength, gain = self.settings[index]
        return MemoryMethod(banks, layers=sorted(units), strength=strength,
                            units={layer: list(u) for layer, u in units.items()},
                            unit_type=self.unit_type, layer_gains=dict.fromkeys(units, gain))

    def _cost(self, units: Units, index: int) -> float:
        key = (tuple(sorted(units.items())), index)
        if key not in self._costs:
            with self._lock:
                self.cost_probes += 1
            self._costs[key] = self.objective.cost.measure(
                self._method(self.banks, units, index))
        return self._costs[key]

    def judged_by(self, objective: ShiftObjective) -> BudgetSearch:
        """The same search scoring ``objective`` (e.g. validation pairs) instead: the same
        banks, control, dial and ceilings, and the same cost caches (a site's costs do not
        depend on the pairs), with a history of its own."""
        return replace(self, objective=objective, history=[], cost_probes=0)

    def capability_cost(self, units: Units, index: int) -> float | None:
        """Nats per factual answer the setting costs (None without a capability ceiling)."""
        if self.capability is None:
            return None
        key = (tuple(sorted(units.items())), index)
        if key not in self._capability:
            self._capability[key] = self.capability.measure(
                self._method(self.banks, units, index))
        return self._capability[key]

    def within(self, units: Units, index: int) -> bool:
        """Whether setting ``index`` at ``units`` is within the capability ceiling, where there
        is one, and the cost budget. The capability check goes first: on the embedded model it
        is the cheaper probe (14 short answers against the neutral text: 1.3 s against 2.1 s)
        and the one that binds (personas page, "Where the default call's time goes")."""
        if self.capability is not None and (self.capability_cost(units, index)
                                            > self.capability_ceiling):
            return False
        return self._cost(units, index) <= self.cost_budget

    def strongest(self, units: Units) -> int:
        """Index of the strongest dial setting within budget at ``units`` (-1: none): the
        module docstring's bisection, bounded by the configurations already searched."""
        frozen = tuple(sorted(units.items()))
        if frozen not in self._strongest:
            low, high = self._known_bounds(units)
            if low >= 0 and not self.within(units, low):  # the bound failed: search below it
                low, high = -1, low - 1
            self._strongest[frozen] = self._bisect(lambda i: self.within(units, i), low, high)
        return self._strongest[frozen]

    def _known_bounds(self, units: Units) -> tuple[int, int]:
        """(lowest, highest) index the answer at ``units`` can have, from the configurations
        searched before (-1 and the top of the dial when none bounds it)."""
        low, high = -1, len(self.settings) - 1
        for other, found in list(self._strongest.items()):  # a snapshot: threads add to it
            other = dict(other)
            if _contains(units, other):
                high = min(high, found)
            elif _contains(other, units):
                low = max(low, found)
        return min(low, high), high

    @staticmethod
    def _bisect(holds, low: int, high: int) -> int:
        """The largest index in ``(low, high]`` where ``holds`` (monotone: true up to some
        index), or ``low`` (known to hold, or -1) where it holds nowhere there."""
        while low < high:
            middle = (low + high + 1) // 2
            if holds(middle):
                low = middle
            else:
                high = middle - 1
        return low

    def score(self, units: Units, index: int | None = None) -> SiteScore:
        """Measure ``units`` at grid strength ``index`` (default: the strongest within budget);
        no strength within budget scores as the plain model, exactly 0, without a pass. A
        configuration over the KV ceiling is refused (ValueError)."""
        return self._record(self._scored(units, index))

    def score_each(self, configurations: Sequence[Units]) -> list[SiteScore]:
        """:meth:`score` of each configuration, in order, measured in up to ``workers``
        threads where none contains another (so that no one's dial search starts from
        another's answer, :meth:`strongest`): the same scores, history and caches as one
        after the other (the progress bar advances as each is measured)."""
        configurations = list(configurations)
        nested = any(_contains(a, b) for i, a in enumerate(configurations)
                     for j, b in enumerate(configurations) if i != j)
        if nested:
            return [self.score(units) for units in configurations]
        results = map_in_threads(self._scored, configurations, self.workers,
                                 finished=self._advance)
        self.history.extend(results)
        return results

    def _scored(self, units: Units, index: int | None = None) -> SiteScore:
        """:meth:`score`'s measurement, not yet recorded in the history."""
        if not self.fits(units):
            raise ValueError(f"the configuration {units} carries {self.kv_bytes(units)} bytes "
                             f"of banks, over the KV ceiling of {self.kv_ceiling}")
        layers = tuple(sorted(units))
        frozen = tuple(sorted(units.items()))
        index = self.strongest(units) if index is None else index
        if index < 0:
            return SiteScore(layers, 1.0, 0.0, 0.0, 0.0, strength=0.0, cost=0.0,
                             presence=0.0 if self.control is not None else None, units=frozen)
        strength, gain = self.settings[index]
        measured = self._measured(units, index)
        return SiteScore(layers, gain, strength=strength, units=frozen,
                         capability=self.capability_cost(units, index), **measured)

    def _advance(self, _result: SiteScore) -> None:
        if self.progress_bar is not None:
            self.progress_bar.update()

    def _record(self, result: SiteScore) -> SiteScore:
        """``result`` into the history, the progress bar advanced."""
        self._advance(result)
        self.history.append(result)
        return result

    def _measured(self, units: Units, index: int) -> dict[str, float]:
        """The objective's measurement of ``units`` at setting ``index``, net of the control;
        read from the shared probes where a search with the same objective and control
        measured it (an objective without a ``key`` is always measured)."""
        shared = self.control is None or self.control is self.probes.recipe_control
        objective_key = getattr(self.objective, "key", None)
        key = ((objective_key, self.control is not None, tuple(sorted(units.items())), index)
               if shared and objective_key is not None else None)
        if key is not None and key in self.probes.scores:
            return self.probes.scores[key]
        control = (self._method(self.control, units, index)
                   if self.control is not None else None)
        measured = self.objective.measure(self._method(self.banks, units, index),
                                          control=control, cost=self._cost(units, index))
        if key is not None:
            self.probes.scores[key] = measured
        return measured

    def every_layer(self, layers: Sequence[int]) -> SiteScore | None:
        """Every layer of ``layers`` whose bank alone (all units, full strength at the base
        gain) costs within the budget, scored together at the strongest setting within budget;
        None when fewer than two layers qualify, or when ``layers`` together are over the KV
        ceiling (then the visible prompt's configuration is out of reach: no probe is run)."""
        every = tuple(range(self.num_units))
        if not self.fits(dict.fromkeys(layers, every)):
            return None
        full = len(self.strengths) - 1  # the setting (1.0, base gain)
        layers = sorted(set(layers))
        costs = map_in_threads(lambda layer: self._cost({layer: every}, full), layers,
                               self.workers)  # independent probes
        cheap = [layer for layer, cost in zip(layers, costs, strict=True)
                 if cost <= self.cost_budget]
        units = dict.fromkeys(cheap, every)
        return self.score(units) if len(cheap) > 1 and self.fits(units) else None

    def greedy(self, best: SiteScore, moves: Sequence[Any],
               trial_of: Callable[[SiteScore, Any], Units | None],
               shown: Callable[[list[SiteScore]], Any] = lambda results: None, *,
               stop: Callable[[SiteScore], bool] = lambda best: False) -> SiteScore:
        """A greedy stage: each move's trial (``trial_of(best, move)``; None: no trial) scored
        in turn against the best so far, kept where it scores higher, until ``stop(best)``.

        With ``workers`` > 1 the next moves' trials are measured side by side, each against
        the same best; they are taken in order, and those after a trial that wins are
        discarded (measured again against the new best where their move comes up). A
        discarded trial leaves only what its probes measured (costs, scores: the same values
        whenever they are asked for again), never its dial answer, which would bound later
        dial searches (:meth:`strongest`): the same history, choice and dial answers as one
        trial at a time; only the probe counts can be larger. ``shown`` is called with each
        recorded trial (a progress bar's postfix)."""
        position = 0
        while position < len(moves) and not stop(best):
            batch, scan = [], position
            while scan < len(moves) and len(batch) < self.workers:
                units = trial_of(best, moves[scan])
                scan += 1
                if units is not None:
                    batch.append((scan, units))
            if not batch:
                break
            configurations = [units for _, units in batch]
            if any(_contains(a, b) for i, a in enumerate(configurations)
                   for j, b in enumerate(configurations) if i != j):
                batch, configurations = batch[:1], configurations[:1]
            known = set(self._strongest)
            results = map_in_threads(self._scored, configurations, self.workers)
            for k, ((after, _), result) in enumerate(zip(batch, results, strict=True)):
                shown([self._record(result)])
                position = after
                if result.score > best.score:
                    best = result
                    for units in configurations[k + 1:]:  # discarded: forget their answers
                        frozen = tuple(sorted(units.items()))
                        if frozen not in known:
                            self._strongest.pop(frozen, None)
                    break
            else:
                position = batch[-1][0]
        return best

    def run(self, candidates: Sequence[int], *, top_layers: int, unit_search: bool = True,
            layer_stride: int = 1, progress: bool = True) -> SiteScore:
        """The three stages of the module docstring; returns the best configuration. With
        ``layer_stride`` k > 1, stage 1 scores every k-th candidate only (neighbouring layers
        act alike; a calibration costs about 1/k as much) and stage 2 adds from those."""
        if isinstance(layer_stride, bool) or not isinstance(layer_stride, int) or layer_stride < 1:
            raise ValueError(f"layer_stride must be a positive integer, got {layer_stride!r}")
        candidates = sorted({int(i) for i in candidates})[::layer_stride]
        if not candidates:
            raise ValueError("the search needs at least one candidate layer")
        if not 1 <= top_layers <= len(candidates):
            raise ValueError(f"top_layers must be in [1, {len(candidates)}], got {top_layers}")
        outer = self.progress_bar is not None
        bar = self.progress_bar if outer else tqdm(desc="budgeted site search",
                                                   disable=not progress)

        def shown(results: list[SiteScore]) -> list[SiteScore]:
            if not outer:
                bar.update(len(results))
            if self.history:
                bar.set_postfix_str(f"best {max(h.score for h in self.history):+.2f}",
                                    refresh=False)
            return results

        fitting = {layer: self.fitting(layer) for layer in candidates}
        singles = shown(self.score_each([{layer: fitting[layer]} for layer in candidates
                                          if fitting[layer]]))
        if not singles:
            raise ValueError(f"no candidate layer fits the KV ceiling of {self.kv_ceiling} "
                             f"bytes: one KV head of the banks at one layer is "
                             f"{self._slot_bytes} bytes; raise the ceiling or build smaller "
                             "banks")
        order = [s.layers[0] for s in sorted(singles, key=lambda s: (-s.score, s.layers))]
        best = max(singles, key=lambda s: (s.score, -s.layers[0]))

        def added(best: SiteScore, layer: int) -> Units | None:
            """Stage 2's trial: ``layer`` (the KV groups of it that fit) beside ``best``."""
            extra = self.fitting(layer, dict(best.units)) if layer not in best.layers else ()
            return {**dict(best.units), layer: extra} if extra else None

        best = self.greedy(best, order[:top_layers], added, shown,
                           stop=lambda best: len(best.layers) >= top_layers)
        if unit_search:
            best = self.greedy(best, [(layer, unit) for layer, units in best.units or ()
                                      for unit in units], _without, shown)
        if not outer:
            bar.close()
        return best


def _without(best: SiteScore, move: tuple[int, int]) -> Units | None:
    """Stage 3's trial: ``best`` less one unit (``(layer, unit)``; the layer goes with its last
    unit), or None where ``best`` does not steer it or nothing would be left."""
    layer, unit = move
    current = dict(best.units)
    if layer not in current or unit not in current[layer]:
        return None
    kept = tuple(u for u in current[layer] if u != unit)
    trial = {k: v for k, v in current.items() if k != layer}
    if kept:
        trial[layer] = kept
    return trial or None


def _contains(outer: Units, inner: Units) -> bool:
    """Whether every unit ``inner`` steers is steered by ``outer`` too."""
    return all(layer in outer and set(units) <= set(outer[layer])
               for layer, units in inner.items())
