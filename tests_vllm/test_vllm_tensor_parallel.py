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
def test_two_ranks_serve_what_steer_computes(kind, tmp_path):
    model = tiny_model(kind, tmp_path / "model")
    banks = BankSet([random_bank(model, "up", "target", 2),
                     random_bank(model, "down", "reference", 3, layers=(1, 2))], model=model)
    banks.save_pretrained(tmp_path / "contrastive")
    # KV group 1 only at layer 0 (the second rank's heads), both at layer 2, half strength
    selector = Selector(layers=[0, 2], units={0: [1], 2: [0, 1]}, unit_type="kv_group",
                        layer_gains={0: 1.0, 2: 1.0}, candidate_layers=[0, 1, 2], strength=0.5)
    selector.save_pretrained(tmp_path / "half")
    registry = write_registry(tmp_path / "registry.json", model,
                              {"contrastive": tmp_path / "contrastive"},
                              selectors={"half": tmp_path / "half"})
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
        served = vllm_greedy(llm, [prompt for _, prompt in batch],
                             [None if name is None
                              else steering_args(name) if how is None
                              else steering_args(name, selector=how)
                              for (name, how, _), _ in batch])
    for (key, _), result in zip(batch, served, strict=True):
        assert_same(expected[key], result)



def test_every_rank_refuses_a_bank_set_past_the_limit(tmp_path, capfd):
    """Each worker loads the registry and checks the size limit itself: at tensor parallel 2 both
    ranks refuse the over-limit bank set, a request naming it gets one clear error, and a bank set
    within the limit still steers as ``steer()`` does."""
    model = tiny_model("llama", tmp_path / "model")
    within = BankSet([random_bank(model, "up", "target", 2)], model=model)  # 12 slot-layers
    within.save_pretrained(tmp_path / "within")
    BankSet([random_bank(model, "big", "target", 3, layers=(0, 1, 2))],  # 18 slot-layers
            model=model).save_pretrained(tmp_path / "big")
    registry = write_registry(tmp_path / "registry.json", model, {"within": tmp_path / "within"},
                              max_slot_layers=12)
    record = json.loads(registry.read_text())  # write_registry itself refuses the big one
    record["bank_sets"]["big"] = {"banks": str(tmp_path / "big"), "selector": None}
    registry.write_text(json.dumps(record))
    prompt = tiny_prompts()[1]
    expected = hf_greedy(model, prompt, {"banks": within})
    with environment(**THREADS), engine(tmp_path / "model", registry, skip_tokenizer_init=True,
                                        tensor_parallel_size=2,
                                        distributed_executor_backend="mp") as llm:
        with pytest.raises(VLLMValidationError, match="max_slot_layers"):
            vllm_greedy(llm, [prompt], [steering_args("big")])
        assert_same(expected, vllm_greedy(llm, [prompt], [steering_args("within")])[0])
    refusal = "bank set 'big' cannot steer this model and will be refused"
    assert capfd.readouterr().err.count(refusal) == 2  # once per rank
