"""The plugin under tensor parallelism: vLLM's CPU backend with ``tensor_parallel_size=2`` (two
worker processes, each holding half of every layer's query and KV heads), steered, unsteered and
mixed in one batch, against ``steer()`` in transformers. A GQA family whose two KV heads split
across the ranks (Llama) and one with sliding windows (Mistral)."""

from __future__ import annotations

import json

import pytest
from vllm.exceptions import VLLMValidationError

from hf_memory import BankSet, Selector
from hf_memory_vllm import steering_args, write_registry

from .references import hf_greedy
from .test_vllm_plugin import (
    assert_same,
    engine,
    environment,
    random_bank,
    tiny_model,
    tiny_prompts,
    vllm_greedy,
)

# The CPU backend binds each worker's threads to a NUMA node and refuses two workers on one
# node; bound by hand, one core each (the CI machine has two).
THREADS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_two_ranks_serve_what_steer_computes_and_each_refuses_a_bank_set_past_the_limit(
        kind, tmp_path, capfd):
    """Every case in one batch equals ``steer()``; each worker loads the registry and checks the
    size limit itself, so both ranks refuse the over-limit bank set and a request naming it gets
    one clear error."""
    model = tiny_model(kind, tmp_path / "model")
    banks = BankSet([random_bank(model, "up", "target", 2),  # 24 slot-layers, the limit
                     random_bank(model, "down", "reference", 3, layers=(1, 2))], model=model)
    banks.save_pretrained(tmp_path / "contrastive")
    BankSet([random_bank(model, "big", "target", 4, layers=(0, 1, 2)),  # 36 slot-layers
             random_bank(model, "bigger", "reference", 5, layers=(0, 1, 2))],
            model=model).save_pretrained(tmp_path / "big")
    # KV group 1 only at layer 0 (the second rank's heads), both at layer 2, half strength
    selector = Selector(layers=[0, 2], units={0: [1], 2: [0, 1]}, unit_type="kv_group",
                        layer_gains={0: 1.0, 2: 1.0}, candidate_layers=[0, 1, 2], strength=0.5)
    selector.save_pretrained(tmp_path / "half")
    registry = write_registry(tmp_path / "registry.json", model,
                              {"contrastive": tmp_path / "contrastive"},
                              selectors={"half": tmp_path / "half"}, max_slot_layers=24)
    record = json.loads(registry.read_text())  # write_registry itself refuses the big one
    record["bank_sets"]["big"] = {"banks": str(tmp_path / "big"), "selector": None}
    registry.write_text(json.dumps(record))
    prompts = tiny_prompts()
    cases = [(None, None), ("contrastive", None), ("contrastive", "half")]
    expected = {}
    for name, how in cases:
        for i, prompt in enumerate(prompts):
            steering = (None if name is None else {"banks": banks} if how is None
                        else {"banks": banks, "selector": selector})
            expected[name, how, i] = hf_greedy(model, prompt, steering)
    assert expected["contrastive", None, 1][0] != expected[None, None, 1][0]  # the banks steer
    batch = [(key, prompts[key[2]]) for key in expected]  # every case in one batch
    with environment(**THREADS), engine(tmp_path / "model", registry, skip_tokenizer_init=True,
                                        tensor_parallel_size=2,
                                        distributed_executor_backend="mp",
                                        max_num_batched_tokens=16, max_num_seqs=16) as llm:
        with pytest.raises(VLLMValidationError, match="max_slot_layers"):
            vllm_greedy(llm, [prompts[1]], [steering_args("big")])
        served = vllm_greedy(llm, [prompt for _, prompt in batch],
                             [None if name is None
                              else steering_args(name) if how is None
                              else steering_args(name, selector=how)
                              for (name, how, _), _ in batch])
    for (key, _), result in zip(batch, served, strict=True):
        assert_same(expected[key], result)
    refusal = "bank set 'big' cannot steer this model and will be refused"
    assert capfd.readouterr().err.count(refusal) == 2  # once per rank
