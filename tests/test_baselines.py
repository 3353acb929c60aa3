"""Baselines with the steering interface: prompt, CAA; the Likert constraint."""

from __future__ import annotations

import pytest
import torch

from hf_memory import BankSet, FingerprintMismatchError, MemoryBank
from hf_memory.baselines.caa import CAAVectors, apply_caa
from hf_memory.baselines.methods import (
    CAAMethod,
    MemoryMethod,
    PlainMethod,
    PromptMethod,
    generate_with,
    generate_with_each,
)
from hf_memory.chat.allowed_tokens import AllowedTokensProcessor
from hf_memory.chat.generation import encode_chats
from hf_memory.models.adapters import get_adapter
from hf_memory.recipes.demo import DEFAULT_PERSONA
from tests.test_memory_inception import token_ids
from tests.test_memory_inception_real import worry_margin
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

PAIRS = [("I am so worried and anxious about everything.",
          "I am so calm and relaxed about everything."),
         ("I'm scared that something will go wrong.",
          "I'm confident that everything will go well."),
         ("My heart races with fear and nervousness.",
          "My heart is steady, peaceful and at ease.")]


@pytest.fixture(scope="module")
def anxious_caa(default_model):
    model, tokenizer = default_model
    return CAAVectors.extract(model, tokenizer, PAIRS, layers=[10], scale=2.0)


@pytest.mark.slow
def test_caa_moves_the_contrastive_probe(default_model, anxious_caa):
    model, tokenizer = default_model
    plain = worry_margin(model, tokenizer)
    with apply_caa(model, anxious_caa):
        steered = worry_margin(model, tokenizer)
    with apply_caa(model, anxious_caa, scale=-2.0):
        opposite = worry_margin(model, tokenizer)
    assert steered > plain + 2.0, (plain, steered)
    assert opposite < plain - 1.0, (plain, opposite)
    assert worry_margin(model, tokenizer) == plain


def test_caa_vector_is_the_mean_residual_difference(default_model):
    model, tokenizer = default_model
    vectors = CAAVectors.extract(model, tokenizer, PAIRS[:2], layers=[3], position="last")
    expected = torch.zeros(model.config.hidden_size, dtype=torch.float64)
    for positive, negative in PAIRS[:2]:
        for text, sign in ((positive, 1), (negative, -1)):
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                hidden = model(ids, output_hidden_states=True).hidden_states[3]
                block = model.model.layers[3]
                normed = block.input_layernorm(hidden)
                positions = torch.arange(ids.shape[1])[None]
                cos, sin = model.model.rotary_emb(hidden, positions)
                attn = block.self_attn(normed, position_embeddings=(cos, sin),
                                       attention_mask=None)[0]
            expected += sign * (hidden + attn)[0, -1].double()
    torch.testing.assert_close(vectors.vectors[3].double(), expected / 2, rtol=1e-4, atol=1e-4)


def test_extraction_stops_at_the_deepest_layer_it_reads_and_reads_the_same(default_model):
    model, tokenizer = default_model
    ids = tokenizer(PAIRS[0][0], return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
    last = model.config.num_hidden_layers - 1
    shallow = CAAVectors.extract(model, tokenizer, PAIRS[:2], layers=[2, 5])
    deep = CAAVectors.extract(model, tokenizer, PAIRS[:2], layers=[2, 5, last])  # every layer
    for layer in (2, 5):
        assert torch.equal(shallow.vectors[layer], deep.vectors[layer])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # no hook left behind


@pytest.mark.parametrize("family", ["llama", "mistral", "granite", "olmo2", "gemma2", "phi3",
                                    "gemma3_text"])
def test_caa_starts_after_the_instruction(family):
    model = tiny_model(family)
    vectors = CAAVectors({1: torch.randn(64, dtype=torch.float64)}, scale=3.0)
    ids = token_ids(1, 8)
    plain = model(ids).logits
    with apply_caa(model, vectors, start_position=5):
        steered = model(ids).logits
    torch.testing.assert_close(steered[:, :5], plain[:, :5], rtol=0, atol=0)
    assert not torch.allclose(steered[:, 5:], plain[:, 5:])
    assert torch.equal(model(ids).logits, plain)


def test_caa_round_trip_and_checks(anxious_caa, default_model, tmp_path):
    model, _ = default_model
    anxious_caa.save_pretrained(tmp_path)
    loaded = CAAVectors.from_pretrained(tmp_path, model=model)
    assert loaded.layers == [10] and loaded.scale == 2.0
    assert torch.equal(loaded.vectors[10], anxious_caa.vectors[10])
    assert loaded.provenance == anxious_caa.provenance
    with pytest.raises(FingerprintMismatchError):
        CAAVectors.from_pretrained(tmp_path, model=tiny_model("llama"))
    with pytest.raises(ValueError, match="finite"):
        CAAVectors({0: torch.tensor([float("nan")])})


@pytest.mark.slow
def test_methods_share_one_interface(default_model, anxious_caa):
    model, tokenizer = default_model
    bank = MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, template="{text}",
                                layers=range(18, 23), gain=2.0)
    methods = [PlainMethod(), PromptMethod(DEFAULT_PERSONA, tokenizer=tokenizer),
               PromptMethod(DEFAULT_PERSONA, placement="prepend"), CAAMethod(anxious_caa),
               MemoryMethod(BankSet([bank], model=model))]
    prompt = ["How do you feel about your exam tomorrow?"]
    answers = [generate_with(m, model, tokenizer, prompt, max_new_tokens=8)[0] for m in methods]
    plain = answers[0]
    assert all(answer != plain for answer in answers[1:2] + answers[3:]), answers
    rendered = tokenizer.apply_chat_template(methods[2].messages(prompt[0]), tokenize=False)
    assert DEFAULT_PERSONA + "\n\n" + prompt[0] in rendered
    assert [m.describe()["method"] for m in methods] == [
        "plain", "prompt", "prompt", "caa", "memory"]
    assert methods[0].guidance_kv_bytes(model, tokenizer, prompt[0]) == 0
    extra = methods[2].guidance_kv_bytes(model, tokenizer, prompt[0])
    added = len(tokenizer(DEFAULT_PERSONA + "\n\n", add_special_tokens=False).input_ids)
    assert extra == pytest.approx(added * 30 * 2 * 3 * 64 * 4, rel=0.1)


def test_likert_constraint_answers_with_a_digit(default_model):
    model, tokenizer = default_model
    likert = AllowedTokensProcessor.from_strings(tokenizer, ["1", "2", "3", "4", "5"])
    question = ("On a scale from 1 (disagree) to 5 (agree): I worry about things. "
                "Answer with one digit.")
    batch = encode_chats(tokenizer, [PlainMethod().messages(question)])
    out = model.generate(**batch, max_new_tokens=1, do_sample=False,
                         logits_processor=[likert], pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(out[0, -1:]) in {"1", "2", "3", "4", "5"}
    with pytest.raises(ValueError, match="single tokens"):
        AllowedTokensProcessor.from_strings(tokenizer, ["strongly agree"])


@pytest.mark.slow
def test_methods_sharing_batches_answer_as_each_alone(default_model, anxious_caa):
    model, tokenizer = default_model
    bank = MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, template="{text}",
                                layers=range(18, 23), gain=2.0)
    methods = [PlainMethod(), PromptMethod(DEFAULT_PERSONA, tokenizer=tokenizer),
               CAAMethod(anxious_caa), MemoryMethod(BankSet([bank], model=model)),
               MemoryMethod(BankSet([bank], model=model), layers=[20])]
    prompts = ["How do you feel about your exam tomorrow?", "Any plans for the weekend?"]
    alone = [generate_with(m, model, tokenizer, prompts, max_new_tokens=8) for m in methods]
    shared = generate_with_each(methods, model, tokenizer, prompts, max_new_tokens=8)
    assert shared == alone
    assert generate_with_each(methods, model, tokenizer, prompts, batch_size=3,
                              max_new_tokens=8) == alone
    assert len({tuple(replies) for replies in alone}) == len(methods)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        generate_with_each(methods, model, tokenizer, prompts, batch_size=0)


# the MLP branch each family adds to the residual stream after attention, written out by hand
# (pre-norm: mlp(norm(r)); Gemma: post_ff_norm(mlp(pre_ff_norm(r))); OLMo-2: post_ff_norm(mlp(r));
# Granite: mlp(norm(r)) times its residual multiplier)
MLP_BRANCH = {
    "gemma2": lambda block, r: block.post_feedforward_layernorm(
        block.mlp(block.pre_feedforward_layernorm(r))),
    "gemma3_text": lambda block, r: block.post_feedforward_layernorm(
        block.mlp(block.pre_feedforward_layernorm(r))),
    "olmo2": lambda block, r: block.post_feedforward_layernorm(block.mlp(r)),
    "granite": lambda block, r: block.mlp(block.post_attention_layernorm(r))
    * block.residual_multiplier,
}


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "granite", "phi3", "olmo2",
                                    "gemma2", "gemma3_text"])
def test_caa_reads_and_writes_the_residual_stream_after_attention(family):
    """Where CAA reads is the residual stream after attention (the decoder layer's output is it
    plus the MLP branch), and applying scale · v moves exactly that stream by scale · v from the
    start position on."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    layer, ids = 1, token_ids(1, 8)
    block = adapter.layers(model)[layer]
    read: list[torch.Tensor] = []
    hook = adapter.residual_read(model, layer).register_forward_pre_hook(
        lambda _m, args: read.append(args[0].detach()))
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            vector = torch.randn(model.config.hidden_size, dtype=torch.float64)
            with apply_caa(model, CAAVectors({layer: vector}, scale=1.5), start_position=3):
                model(ids)
            branch = MLP_BRANCH.get(family, lambda b, r: b.mlp(b.post_attention_layernorm(r)))
            after = read[0] + branch(block, read[0])
            torch.testing.assert_close(out.hidden_states[layer + 1], after, rtol=1e-10,
                                       atol=1e-10)
    finally:
        hook.remove()
    torch.testing.assert_close(read[1][:, :3], read[0][:, :3], rtol=0, atol=0)
    torch.testing.assert_close(read[1][:, 3:], read[0][:, 3:] + 1.5 * vector, rtol=1e-10,
                               atol=1e-10)
