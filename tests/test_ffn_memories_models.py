"""Stock gated MLPs (tiny random Llama / Qwen2 / Qwen3 built in code) and bad input.

The captured coefficients are exactly ``act(gate x) · (up x)``, ``o = r + y`` is exactly the
block output, the lens of the last block is exactly the model's logits, and the streamed
triggers equal a brute-force top-k over every coefficient of the corpus.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_memory.analysis.capture import ffn_streams
from hf_memory.analysis.corpus import TokenizedCorpus, tokenize_corpus
from hf_memory.analysis.corpus_pass import run_corpus_pass
from hf_memory.analysis.logit_lens import logit_lens
from hf_memory.analysis.mlp_adapter import ffn_adapter
from hf_memory.analysis.streaming_topk import topk_reference
from hf_memory.analysis.values import project_values, project_values_signed
from tests.tiny_models import tiny_model

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=24, head_dim=4,
             dtype=torch.float32)
FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 8}}


@pytest.fixture(params=sorted(FAMILIES))
def model(request):
    return tiny_model(request.param, **{**SMALL, **FAMILIES[request.param]})


def random_corpus(count: int = 9) -> TokenizedCorpus:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 11, (count,), generator=generator)
    return TokenizedCorpus.from_token_ids(
        [torch.randint(0, 64, (int(n),), generator=generator).tolist() for n in lengths])


def test_captured_streams_are_exactly_the_models(model):
    adapter = ffn_adapter(model)
    assert adapter.kind == "gated" and adapter.signed
    ids = torch.randint(0, 64, (2, 7))
    outputs = {}
    handles = [layer.register_forward_hook(
        lambda module, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple)
                                                           else out))
        for i, layer in enumerate(model.model.layers)]
    record = ffn_streams(model, adapter, ids)
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        for index, layer in enumerate(adapter.layers):
            x = layer.norm(record.residual[index])
            mlp = layer.mlp
            assert torch.equal(record.coefficients[index],
                               mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
            assert torch.equal(record.ffn_output[index], layer.out_proj(
                record.coefficients[index]))
            assert torch.equal(record.block_output(index), outputs[index])
        assert torch.equal(logit_lens(adapter, record.block_output(2)), logits)


def test_streamed_triggers_equal_brute_force(model):
    corpus = random_corpus()
    passed = run_corpus_pass(model, corpus, top_k=5, batch_size=1, progress=False)
    adapter = ffn_adapter(model)
    coefficients = {layer: [] for layer in range(3)}
    for ids in corpus.token_ids:
        record = ffn_streams(model, adapter, torch.tensor([ids]))
        for layer in range(3):
            coefficients[layer].append(record.coefficients[layer][0, :-1])
    positions = torch.arange(corpus.num_prefixes)
    for layer in range(3):
        matrix = torch.cat(coefficients[layer])
        for polarity, sign in (("+", 1), ("-", -1)):
            values, prefixes = topk_reference(sign * matrix, positions, 5)
            assert torch.equal(passed.triggers[polarity].scores[layer], values)
            assert torch.equal(passed.triggers[polarity].prefixes[layer], prefixes)


def test_batching_does_not_change_the_triggers(model):
    corpus = random_corpus()
    one = run_corpus_pass(model, corpus, top_k=4, batch_size=1, progress=False)
    many = run_corpus_pass(model, corpus, top_k=4, batch_size=4, progress=False)
    for polarity in ("+", "-"):
        torch.testing.assert_close(many.triggers[polarity].scores, one.triggers[polarity].scores)
    assert torch.equal(many.sample, one.sample)
    assert torch.equal(many.top_output[-1], many.final_top)


def test_layer_subset_and_negative_indices(model):
    passed = run_corpus_pass(model, random_corpus(), layers=[-1, 0], top_k=2, progress=False)
    assert passed.layers == (0, 2)
    assert passed.triggers["+"].scores.shape == (2, 24, 2)


def test_unknown_layer_is_a_value_error(model):
    with pytest.raises(ValueError, match="unknown layer index 3: the model has 3 layers"):
        run_corpus_pass(model, random_corpus(), layers=[3], progress=False)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        run_corpus_pass(model, random_corpus(), top_k=0, progress=False)


def test_empty_corpus_is_a_value_error():
    with pytest.raises(ValueError, match="the corpus is empty"):
        TokenizedCorpus.from_token_ids([])
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        TokenizedCorpus.from_token_ids([[1, 2], [3]])

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    with pytest.raises(ValueError, match="the corpus is empty"):
        tokenize_corpus(Tokenizer(), [])
    assert tokenize_corpus(Tokenizer(), ["ab"]).num_prefixes == 1


def test_mixture_of_experts_mlp_is_unsupported():
    model = tiny_model("qwen3_moe", **{**SMALL, "head_dim": 8})
    with pytest.raises(ValueError, match="unsupported MLP Qwen3MoeSparseMoeBlock in layer 0"):
        ffn_adapter(model)


def test_model_without_the_layout_is_a_value_error():
    with pytest.raises(ValueError, match="does not have the expected layout"):
        ffn_adapter(torch.nn.Linear(2, 2))


def _projected_alone(adapter, layer, sign, wanted):
    """Top token and target ranks of ``sign · v`` for every value, from one direct lens pass."""
    logits = logit_lens(adapter, adapter.layers[layer].values * sign)
    rank = (logits[:, None, :] > logits.gather(1, wanted)[:, :, None]).sum(-1)
    return logits.argmax(-1), rank


@pytest.mark.parametrize("biased", [False, True], ids=["odd-lens", "biased-unembedding"])
def test_both_polarities_from_one_projection_equal_each_projected_alone(model, biased,
                                                                        monkeypatch):
    import hf_memory.analysis.values as values

    adapter = ffn_adapter(model)
    if biased:  # lens(-v) != -lens(v): each sign is projected on its own
        unembedding = torch.nn.Linear(16, 64)
        adapter = dataclasses.replace(adapter, unembedding=unembedding)
    generator = torch.Generator().manual_seed(0)
    wanted = {1: torch.randint(0, 64, (24, 3), generator=generator),
              -1: torch.randint(0, 64, (24, 2), generator=generator)}
    calls = []
    monkeypatch.setattr(values, "logit_lens",
                        lambda *args: calls.append(1) or logit_lens(*args))
    both = project_values_signed(adapter, 1, wanted, chunk=5)  # chunks of 5, 5, ..., 4
    # one pass per chunk where the lens is odd (two for the first, which decides), else two
    assert len(calls) == (2 * 5 if biased else 5 + 1)
    monkeypatch.undo()
    for sign in (1, -1):
        top, rank = _projected_alone(adapter, 1, sign, wanted[sign])
        assert torch.equal(both[sign][0], top) and torch.equal(both[sign][1], rank)
        assert torch.equal(project_values(adapter, 1, sign, wanted[sign])[0], top)
    minus_only = project_values_signed(adapter, 1, {-1: None})[-1]
    assert torch.equal(minus_only[0], both[-1][0]) and minus_only[1] is None
    with pytest.raises(ValueError, match="signs must be"):
        project_values_signed(adapter, 1, {2: None})
