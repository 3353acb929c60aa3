"""The assign-and-add generator: grammar, labels, held-out pairs and restricted positions."""

from __future__ import annotations

import math
import random

import pytest
import torch

from modeling.arith import (
    CURATED_POOLS,
    POOLS,
    SPLITS,
    ArithTask,
    arith_dataset,
    decode,
    sample_batch,
)
from modeling.arith.data_arith import sample_pool

TASK = ArithTask()


def parse(task: ArithTask, row: list[int]) -> dict:
    """Independent reading of one sequence; asserts the grammar on the way."""
    n, p = task.modulus, task.prefix_len
    assert len(row) == task.seq_len
    assert row[p] == task.plus_id and row[p + 3] == task.equals_id
    env, src, i = {}, {}, 0
    while i < p:
        tok = row[i]
        if tok == task.pad_id:
            i += 1
            continue
        assert task.var_offset <= tok < task.vocab_size, f"position {i}: {tok} is not a variable"
        assert i + 1 < p and row[i + 1] < n, f"variable at {i} not followed by a number"
        var = tok - task.var_offset
        assert var not in env, "a variable is assigned twice"
        env[var], src[var] = row[i + 1], i + 1
        i += 2
    assert task.min_assignments <= len(env) <= task.max_assignments
    operands = []
    for slot in (p + 1, p + 2):
        tok = row[slot]
        if tok < n:
            operands.append((None, tok, slot))
        else:
            assert task.var_offset <= tok < task.vocab_size
            var = tok - task.var_offset
            assert var in env, "a variable is used before it is assigned"
            operands.append((var, env[var], src[var]))
    (lv, lval, lsrc), (rv, rval, rsrc) = operands
    return {"lhs_var": lv, "rhs_var": rv, "lhs": lval, "rhs": rval, "lhs_src": lsrc,
            "rhs_src": rsrc, "label": (lval + rval) % n, "num_vars": (lv is not None)
            + (rv is not None), "num_assignments": len(env)}


def check_batch(task: ArithTask, batch: dict[str, torch.Tensor]) -> list[dict]:
    parsed = []
    for i, row in enumerate(batch["input_ids"].tolist()):
        info = parse(task, row)
        assert info["label"] == batch["labels"][i].item()
        assert info["num_vars"] == batch["num_vars"][i].item()
        assert info["lhs"] == batch["lhs"][i].item() and info["rhs"] == batch["rhs"][i].item()
        assert info["lhs_src"] == batch["lhs_src"][i].item()
        assert info["rhs_src"] == batch["rhs_src"][i].item()
        assert (info["lhs_var"] if info["lhs_var"] is not None else -1) == batch["lhs_var"][i]
        assert (info["rhs_var"] if info["rhs_var"] is not None else -1) == batch["rhs_var"][i]
        parsed.append(info)
    return parsed


def bad_count(task: ArithTask, info: dict) -> int:
    return (info["lhs_var"] in task.no_lhs_variables) + (info["rhs_var"] in task.no_rhs_variables)


@pytest.mark.parametrize("task", [
    TASK,
    ArithTask(no_lhs_variables=(0, 1), no_rhs_variables=(6, 7), held_out_fraction=0.5,
              two_var_ratio=0.3, split_seed=3),  # the paper's section-3 reading
    ArithTask(modulus=7, num_variables=3, seq_len=10, held_out_fraction=0.6,
              no_lhs_variables=(2,), no_rhs_variables=(0,)),
], ids=["default", "section3-f0.5-r0.3", "N7-V3-T10"])
def test_training_stream_never_emits_a_held_out_pair_or_restricted_position(task):
    held_out = task.held_out_mask()
    gen = torch.Generator().manual_seed(1)
    seen_types, seen_sides, seen_pairs = set(), set(), set()
    for _ in range(4):
        batch = sample_batch(task, 2000, gen, held_out=held_out)
        for info in check_batch(task, batch):
            assert not held_out[info["lhs"], info["rhs"]]
            assert info["lhs_var"] not in task.no_lhs_variables
            assert info["rhs_var"] not in task.no_rhs_variables
            seen_types.add(info["num_vars"])
            seen_pairs.add((info["lhs"], info["rhs"]))
            if info["num_vars"] == 1:
                seen_sides.add("left" if info["lhs_var"] is not None else "right")
    assert seen_types == {0, 1, 2} and seen_sides == {"left", "right"}
    if task.modulus == 7:  # small enough to see every allowed pair
        assert len(seen_pairs) == int((~held_out).sum())


@pytest.mark.parametrize("name", list(POOLS) + list(CURATED_POOLS))
def test_every_pool_follows_the_grammar_and_its_split(name):
    spec = {**POOLS, **CURATED_POOLS}[name]
    held_out = TASK.held_out_mask()
    batch = sample_pool(TASK, spec, 600, seed=5, held_out=held_out)
    infos = check_batch(TASK, batch)
    assert {i["num_vars"] for i in infos} == set(spec.num_vars)
    for info in infos:
        assert bool(held_out[info["lhs"], info["rhs"]]) == (spec.pairs == "held_out")
        bad = bad_count(TASK, info)
        if spec.bad_positions >= 0:
            assert bad == spec.bad_positions
        else:
            assert bad >= 1
    if spec.bad_positions == -1:  # novel positions: both single and double restrictions occur
        assert {bad_count(TASK, i) for i in infos} == {1, 2}


def test_held_out_fraction_and_split_seed():
    mask = TASK.held_out_mask()
    assert mask.shape == (59, 59) and int(mask.sum()) == 3481 - int(0.7 * 59 * 59) == 1045
    assert torch.equal(mask, ArithTask().held_out_mask())
    assert not torch.equal(mask, ArithTask(split_seed=1).held_out_mask())
    for split in SPLITS:
        assert int(ArithTask(held_out_fraction=0.0, held_out_split=split)
                   .held_out_mask().sum()) == 0


def test_default_split_is_the_authors_sample_of_training_pairs():
    # the authors' code: P row-major, random.Random(42).sample(P, 2436) are the training pairs
    pairs = [(a, b) for a in range(59) for b in range(59)]
    trained = set(random.Random(42).sample(pairs, 2436))
    mask = TASK.held_out_mask()
    assert TASK.split_seed == 42
    assert {(a, b) for a, b in pairs if not mask[a, b]} == trained


def test_torch_split_keeps_the_first_versions_pairs():
    task = ArithTask(held_out_split="torch")
    assert task.split_seed == 0
    order = torch.randperm(59 * 59, generator=torch.Generator().manual_seed(0))
    expected = torch.zeros(59 * 59, dtype=torch.bool)
    expected[order[:round(0.3 * 59 * 59)]] = True
    assert torch.equal(task.held_out_mask(), expected.view(59, 59))


def test_default_mix_is_the_authors_12_20_10():
    nv = sample_batch(TASK, 42_000, torch.Generator().manual_seed(5))["num_vars"]
    for k, share in enumerate((12 / 42, 20 / 42, 10 / 42)):
        sigma = math.sqrt(share * (1 - share) / len(nv))
        assert abs((nv == k).float().mean().item() - share) <= 5 * sigma


@pytest.mark.parametrize("ratio", [0.0, 0.25, 2.0])
def test_two_var_ratio_sets_the_type_frequencies(ratio):
    task = ArithTask(two_var_ratio=ratio, one_var_ratio=1.0)
    nv = sample_batch(task, 20_000, torch.Generator().manual_seed(2))["num_vars"]
    expected = ratio / (2 + ratio)
    sigma = math.sqrt(max(expected * (1 - expected), 1e-12) / len(nv))
    assert abs((nv == 2).float().mean().item() - expected) <= 5 * sigma + 1e-9
    assert abs((nv == 0).float().mean().item() - 1 / (2 + ratio)) <= 0.02


def test_assignment_counts_and_pad_layout_vary():
    infos = check_batch(TASK, sample_batch(TASK, 3000, torch.Generator().manual_seed(3)))
    assert {i["num_assignments"] for i in infos} == set(range(1, 7))
    starts = {i["lhs_src"] for i in infos if i["lhs_var"] is not None}
    assert starts == set(range(1, 12))  # a value can sit at every prefix position but 0


def test_seeded_draws_are_reproducible():
    a = sample_batch(TASK, 64, torch.Generator().manual_seed(9))
    b = sample_batch(TASK, 64, torch.Generator().manual_seed(9))
    c = sample_batch(TASK, 64, torch.Generator().manual_seed(10))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], c["input_ids"])


def test_arith_dataset_is_a_datasets_dataset():
    ds = arith_dataset(TASK, 32, seed=4, pool="2var/var_restricted(2)")
    assert len(ds) == 32 and {"input_ids", "labels", "text"} <= set(ds.column_names)
    row = ds[0]
    assert row["text"] == decode(TASK, row["input_ids"])
    assert row["text"].split()[-4] == "+" and row["text"].split()[-1] == "="
    assert parse(TASK, row["input_ids"])["label"] == row["labels"]
    assert len(arith_dataset(TASK, 8, seed=4)) == 8
    with pytest.raises(ValueError, match="unknown pool"):
        arith_dataset(TASK, 8, seed=4, pool="3var")


def test_decode_matches_the_papers_notation():
    ids = [TASK.pad_id, TASK.var_offset + 2, 1, TASK.pad_id, TASK.var_offset + 5, 17,
           TASK.var_offset, 42, TASK.pad_id, TASK.pad_id, TASK.pad_id, TASK.pad_id,
           TASK.plus_id, TASK.var_offset + 5, 19, TASK.equals_id]
    assert decode(TASK, ids) == "PAD c 1 PAD f 17 a 42 PAD PAD PAD PAD + f 19 ="
    assert parse(TASK, ids)["label"] == 36


@pytest.mark.parametrize("kwargs, field", [
    ({"modulus": 1}, "modulus"), ({"num_variables": 1}, "num_variables"),
    ({"seq_len": 5}, "seq_len"), ({"max_assignments": 7}, "max_assignments"),
    ({"min_assignments": 0}, "min_assignments"), ({"held_out_fraction": 1.0}, "held_out_fraction"),
    ({"two_var_ratio": -1.0}, "two_var_ratio"), ({"one_var_ratio": -0.5}, "one_var_ratio"),
    ({"held_out_split": "mine"}, "held_out_split must be one of authors, torch"),
    ({"no_lhs_variables": (12,)}, "no_lhs_variables"),
    ({"no_rhs_variables": tuple(range(12))}, "no_rhs_variables restricts every variable"),
])
def test_invalid_task_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithTask(**kwargs)
