"""The vLLM plugin against ``steer()``: the same tokens and log-probs, plain, steered and mixed.

Runs in the vLLM environment (``make test-vllm``): tiny random Llama and Qwen3 models built here,
and the embedded SmolLM2-135M-Instruct with its shipped selectors. Every comparison is greedy
decoding with per-token log-probs; ``TOLERANCE`` is the float32 gap between vLLM's fused kernels
and transformers' matmuls that plain (unsteered) decoding already shows (measured ~2e-5 nats).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from hf_memory import BankSet, MemoryBank, Selector
from hf_memory.models.adapters import UnsupportedModelError
from hf_memory_vllm import REGISTRY_ENV, cache_salt, steering_args, write_registry

from .references import NEW_TOKENS, TOLERANCE, chat, hf_greedy

BLOCK = 32  # KV block size of every engine here: prompts of 40+ tokens span blocks


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables for one engine's life and restore them after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def engine(model_dir: Path, registry: Path | None, **kwargs):
    """An in-process vLLM engine on the CPU, float32, eager, small KV cache."""
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if registry is not None:
        settings[REGISTRY_ENV] = str(registry)
    with environment(**settings):
        llm = LLM(str(model_dir), dtype="float32", seed=0,
                  enforce_eager=kwargs.pop("enforce_eager", True),
                  max_model_len=kwargs.pop("max_model_len", 512), block_size=BLOCK,
                  kv_cache_memory_bytes=128 << 20, **kwargs)
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def vllm_greedy(llm: LLM, prompts: list[list[int]], args: list[dict | None], *,
                salted: bool = True) -> list[tuple]:
    requests, params = [], []
    for prompt, extra in zip(prompts, args, strict=True):
        request = TokensPrompt(prompt_token_ids=prompt)
        if extra and salted:
            request["cache_salt"] = cache_salt(extra)
        requests.append(request)
        params.append(SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                                     ignore_eos=True, extra_args=extra))
    results = []
    for output in llm.generate(requests, params, use_tqdm=False):
        sample = output.outputs[0]
        results.append((list(sample.token_ids),
                        [step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids,
                                                            strict=True)]))
    return results


def assert_same(reference: tuple, served: tuple) -> None:
    assert served[0] == reference[0]
    gap = max(abs(a - b) for a, b in zip(reference[1], served[1], strict=True))
    assert gap < TOLERANCE, gap


# -- tiny random models -------------------------------------------------------------------------

TINY = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "granite": (GraniteConfig, GraniteForCausalLM,
                {"attention_multiplier": 0.1, "embedding_multiplier": 2.0,
                 "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"partial_rotary_factor": 0.5}),
    # windows shorter than the 45- and 120-token prompts: bank slots stay visible past them
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 32}),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                {"sliding_window": 24, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # soft-capped logits (a cap low enough to bind), alternating sliding and global layers
    "gemma2": (Gemma2Config, Gemma2ForCausalLM,
               {"sliding_window": 16, "attn_logit_softcapping": 5.0,
                "query_pre_attn_scalar": 24, "final_logit_softcapping": None,
                "tie_word_embeddings": True, "initializer_range": 0.02}),  # vLLM ties Gemma 2
    # per-head q/k norm; local (sliding) and global layers with their own rotary maps
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM,
                    {"sliding_window": 16, "query_pre_attn_scalar": 24,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                     "tie_word_embeddings": True, "initializer_range": 0.02}),
}


def tiny_model(kind: str, directory: Path):
    config_class, model_class, extra = TINY[kind]
    config = config_class(**{**dict(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None), **extra})
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    if kind == "gemma2":  # SDPA does not soft-cap: steer() and transformers need eager
        model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None  # decode the whole window, as vLLM does here
    model.save_pretrained(directory)
    return model


def random_bank(model, name: str, role: str, seed: int, layers=(0, 2),
                positions: torch.Tensor | None = None) -> MemoryBank:
    generator = torch.Generator().manual_seed(seed)
    shape = (len(layers), 2, 6, 32)
    return MemoryBank.from_tensors(torch.randn(shape, generator=generator) * 2,
                                   torch.randn(shape, generator=generator), name=name, role=role,
                                   layers=layers, gain=1.5, positions=positions)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = tiny_model(request.param, root / "model")
    target = BankSet([random_bank(model, "up", "target", 1)], model=model)
    contrastive = BankSet([random_bank(model, "up", "target", 2),
                           # slots at absolute positions: scored after the layer's rotary map
                           random_bank(model, "down", "reference", 3, layers=(1, 2),
                                       positions=torch.arange(6) * 7)],
                          model=model)
    # the first token keeps the stock output (the persona recipes' banks)
    shielded = BankSet([random_bank(model, "up", "target", 4)], model=model,
                       sink_reads_banks=False)
    target.save_pretrained(root / "target")
    contrastive.save_pretrained(root / "contrastive")
    shielded.save_pretrained(root / "shielded")
    # a selector at part strength (the dial a cost-budgeted calibration freezes), one KV group
    # at layer 0 and both at layer 2
    Selector(layers=[0, 2], units={0: [1], 2: [0, 1]}, unit_type="kv_group",
             layer_gains={0: 1.0, 2: 1.0}, candidate_layers=[0, 1, 2],
             strength=0.5).save_pretrained(root / "half")
    registry = write_registry(root / "registry.json", model,
                              {"target": root / "target", "contrastive": root / "contrastive",
                               "shielded": root / "shielded"},
                              selectors={"half": root / "half"})
    return model, root, registry, {"target": target, "contrastive": contrastive,
                                   "shielded": shielded}


def tiny_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in (9, 45, 120)]


def test_tiny_models_steered_unsteered_and_mixed_match_transformers(tiny):
    model, root, registry, bank_sets = tiny
    prompts = tiny_prompts()
    cases = [(None, None), ("target", None), ("contrastive", None), ("contrastive", 0.5),
             ("target", "half"), ("shielded", None)]
    expected = {}
    for name, scale in cases:
        for i, prompt in enumerate(prompts):
            steering = None
            if scale == "half":
                steering = {"banks": bank_sets[name],
                            "selector": Selector.from_pretrained(root / "half")}
            elif name is not None:
                gains = None if scale is None else {layer: scale for layer in range(3)}
                steering = {"banks": bank_sets[name], "layer_gains": gains}
            expected[name, scale, i] = hf_greedy(model, prompt, steering)
    assert expected["target", None, 1][0] != expected[None, None, 1][0]  # the banks steer
    # the same bank read by the first token or not: different log-probs (so the case tells)
    shielded_reading = hf_greedy(model, prompts[1], {"banks": BankSet(
        bank_sets["shielded"].banks, model=model)})
    assert shielded_reading[1] != expected["shielded", None, 1][1]
    # ...and the half-strength selector is neither the plain model nor the full mixture
    assert expected["target", "half", 1][1] not in (expected[None, None, 1][1],
                                                    expected["target", None, 1][1])
    # chunked prefill: 16-token chunks split the 45- and 120-token prompts over several steps
    with engine(root / "model", registry, skip_tokenizer_init=True,
                max_num_batched_tokens=16, max_num_seqs=16) as llm:
        batch = [(key, prompts[key[2]]) for key in expected]  # every case in one batch
        served = vllm_greedy(llm, [prompt for _, prompt in batch],
                             [None if name is None
                              else steering_args(name, selector=scale) if scale == "half"
                              else steering_args(name, scale=scale)
                              for (name, scale, _), _ in batch])
        for (key, _), result in zip(batch, served, strict=True):
            assert_same(expected[key], result)


def test_an_unsupported_architecture_is_refused_at_start(tmp_path, embedded):
    registry = embedded[3]
    config = GPT2Config(vocab_size=384, n_embd=128, n_layer=2, n_head=4, n_positions=512)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' has no adapter"):
        with engine(tmp_path / "gpt2", registry, skip_tokenizer_init=True):
            pass


def test_a_compiled_engine_is_refused_at_start(embedded):
    _, _, model_dir, registry, _ = embedded
    with pytest.raises(ValueError, match="start vLLM with --enforce-eager"):
        with engine(model_dir, registry, enforce_eager=False):
            pass


# -- the embedded model -------------------------------------------------------------------------

def test_embedded_model_matches_steer_in_a_mixed_batch(embedded):
    from hf_memory import BankSet as Banks

    model, tokenizer, model_dir, registry, root = embedded
    long_text = " ".join(["Tell me what you expect from the exam next week."] * 12)
    prompts = [chat(tokenizer, "What are your plans for the weekend?"), chat(tokenizer, long_text)]
    assert len(prompts[1]) > 4 * BLOCK
    cases = [None, "anxious", "calm"]
    expected = {}
    for name in cases:
        steering = None
        if name is not None:
            steering = {"banks": Banks.from_pretrained(root / name),
                        "selector": Selector.from_pretrained(root / f"{name}-selector")}
        for i, prompt in enumerate(prompts):
            expected[name, i] = hf_greedy(model, prompt, steering)
    # each steering changes the reference (the calm selector, one KV group at strength 0.625,
    # changes the log-probabilities without changing these greedy tokens)
    assert expected["anxious", 0][0] != expected[None, 0][0]
    assert max(abs(a - b) for a, b in zip(expected["calm", 0][1], expected[None, 0][1],
                                          strict=True)) > 100 * TOLERANCE
    with engine(model_dir, registry, max_num_batched_tokens=64, max_num_seqs=8) as llm:
        keys = list(expected)
        served = vllm_greedy(llm, [prompts[i] for _, i in keys],
                             [steering_args(name) if name else None for name, _ in keys])
        for key, result in zip(keys, served, strict=True):
            assert_same(expected[key], result)
        # bad requests are refused one by one and the engine goes on serving
        for bad, message in ((steering_args("excited"), "unknown bank set 'excited'"),
                             ({"memory_bank_set": "calm", "memory_scale": -1}, "memory_scale"),
                             ({"memory_bank_set": "calm", "memory_gain": 2}, "unknown steering"),
                             ({"memory_bank_set": 7}, "must name a registered bank set")):
            with pytest.raises(VLLMValidationError, match=message):
                vllm_greedy(llm, [prompts[0]], [bad], salted=False)
        again = vllm_greedy(llm, [prompts[0]], [steering_args("calm")])[0]
        assert_same(expected["calm", 0], again)


def test_banks_for_another_model_are_refused_per_request(embedded, tmp_path):
    _, tokenizer, model_dir, registry, _ = embedded
    tiny = tiny_model("llama", tmp_path / "tiny")
    BankSet([random_bank(tiny, "up", "target", 1)], model=tiny).save_pretrained(tmp_path / "up")
    record = json.loads(Path(registry).read_text())
    record["bank_sets"]["foreign"] = {"banks": str(tmp_path / "up"), "selector": None}
    edited = tmp_path / "registry.json"
    edited.write_text(json.dumps(record))
    with engine(model_dir, edited) as llm:
        with pytest.raises(VLLMValidationError, match="'foreign'.*different model"):
            vllm_greedy(llm, [chat(tokenizer, "Hi")], [steering_args("foreign")])
        plain = vllm_greedy(llm, [chat(tokenizer, "Hi")], [None])
        assert len(plain[0][0]) == NEW_TOKENS
