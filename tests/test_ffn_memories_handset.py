"""A tiny Llama with hand-set weights whose memories are known: triggers, agreement, cases.

Embeddings and unembedding are the identity (vocab = hidden = 12), attention writes nothing
(``o_proj = 0``), so the residual at a position is the one-hot of its token. Layer 0:
- memory 0 fires (m ≈ +48) only on token A and its value writes token B;
- memory 1 (gated only) fires negatively (m ≈ -48) only on token C; its value is ``-e_D``, so it
  writes D through polarity ``-``. (ReLU variant: it fires positively with value ``+e_D``.)
Every other memory and all of layer 1's MLP are zero.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_memory.analysis.composition import CASES, classify, zero_agreement
from hf_memory.analysis.corpus import TokenizedCorpus
from hf_memory.analysis.corpus_pass import run_corpus_pass
from hf_memory.analysis.mlp_adapter import ffn_adapter
from hf_memory.analysis.report import analyze_ffn_memories
from hf_memory.analysis.values import project_values

A, B, C, D = 3, 5, 7, 9
SENTENCES = [[1, A, B, 2], [2, A, B], [4, A, 6, 1], [C, D, 1], [1, 2, 4, 6], [A, B, C, D],
             [1, A]]  # the last A ends no prefix: it has no next token


class ReLUMLP(nn.Module):
    """Our own models' MLP: fc_in -> ReLU -> fc_out, no gate."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, inner, bias=False)
        self.act = nn.ReLU()
        self.fc_out = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


def handset_model(kind: str) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=12, hidden_size=12, intermediate_size=4, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    eye = torch.eye(12)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(eye)
        model.lm_head.weight.copy_(eye)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            if kind == "relu":
                layer.mlp = ReLUMLP(12, 4)
            for parameter in layer.mlp.parameters():
                parameter.zero_()
        mlp = model.model.layers[0].mlp
        if kind == "gated":
            mlp.gate_proj.weight[0] = 2 * eye[A]
            mlp.up_proj.weight[0] = 2 * eye[A]
            mlp.down_proj.weight[:, 0] = eye[B]
            mlp.gate_proj.weight[1] = 2 * eye[C]
            mlp.up_proj.weight[1] = -2 * eye[C]
            mlp.down_proj.weight[:, 1] = -eye[D]
        else:
            mlp.fc_in.weight[0] = 2 * eye[A]
            mlp.fc_out.weight[:, 0] = eye[B]
            mlp.fc_in.weight[1] = 2 * eye[C]
            mlp.fc_out.weight[:, 1] = eye[D]
    return model


@pytest.fixture(params=["gated", "relu"])
def setup(request):
    return request.param, handset_model(request.param), TokenizedCorpus.from_token_ids(SENTENCES)


def prefixes_ending_at(corpus: TokenizedCorpus, token: int) -> torch.Tensor:
    return (corpus.prefix_last_tokens == token).nonzero().flatten()


def test_the_prefix_ending_at_t_predicts_token_t_plus_1():
    corpus = TokenizedCorpus.from_token_ids([[10, 11, 12], [20, 21]])
    assert corpus.num_prefixes == 3
    assert corpus.prefix_last_tokens.tolist() == [10, 11, 20]
    assert corpus.prefix_targets.tolist() == [11, 12, 21]
    sentence, end = corpus.locate(torch.tensor([0, 1, 2]))
    assert sentence.tolist() == [0, 0, 1] and end.tolist() == [0, 1, 0]


def test_adapter_reads_the_mlp_kind(setup):
    kind, model, _ = setup
    adapter = ffn_adapter(model)
    assert adapter.kind == kind and adapter.signed == (kind == "gated")
    assert adapter.num_memories == 4 and len(adapter.layers) == 2


def test_triggers_of_the_memory_that_fires_on_a(setup):
    kind, model, corpus = setup
    passed = run_corpus_pass(model, corpus, top_k=3, batch_size=2, progress=False)
    at_a = prefixes_ending_at(corpus, A)  # prefix ids in ascending order; A at a sentence end
    assert len(at_a) == 4  # is not a prefix
    triggers = passed.triggers["+"]
    # All four A-prefixes have the same coefficient: ties go to the smaller prefix id.
    assert triggers.prefixes[0, 0].tolist() == at_a[:3].tolist()
    assert (triggers.scores[0, 0] > 5).all()  # 2·sqrt(12) before the activation
    assert corpus.prefix_targets[triggers.prefixes[0, 0]].tolist() == [B, B, 6]
    if kind == "gated":
        assert set(passed.triggers) == {"+", "-"}
        negative = passed.triggers["-"]
        assert negative.prefixes[0, 1].tolist()[:2] == prefixes_ending_at(corpus, C).tolist()
        assert (negative.scores[0, 1, :2] > 40).all()
    else:
        assert set(passed.triggers) == {"+"}
        assert triggers.prefixes[0, 1].tolist()[:2] == prefixes_ending_at(corpus, C).tolist()


def test_value_projection_and_agreement_are_found(setup):
    kind, model, corpus = setup
    results, passed, agreements = analyze_ffn_memories(model, corpus, top_k=3, progress=False)
    adapter = ffn_adapter(model)
    top, _ = project_values(adapter, 0, 1)
    assert top[0].item() == B
    plus = agreements[0]["+"]
    assert plus.agree_top1[0] and plus.agree_any[0]
    assert plus.target_rank[0] == 0  # B is the value's top token
    if kind == "gated":
        assert project_values(adapter, 0, -1)[0][1].item() == D
        assert agreements[0]["-"].agree_top1[1]
        assert results["agreement"]["-"]["top1"][0] == pytest.approx(0.25)
    else:
        assert plus.agree_top1[1]
    assert results["agreement"]["+"]["top1"][0] == pytest.approx(0.25 if kind == "gated" else 0.5)


def test_composition_cases_active_fraction_and_zero_agreement(setup):
    kind, model, corpus = setup
    results, passed, _ = analyze_ffn_memories(model, corpus, top_k=3, progress=False)
    total = corpus.num_prefixes
    assert len(passed.sample) == total  # the sample covers every prefix here
    fired = len(prefixes_ending_at(corpus, A)) + len(prefixes_ending_at(corpus, C))
    share = fired / total
    # Layer 0: at A / C the MLP's token wins over the residual's (ffn); elsewhere y = 0.
    assert results["cases"]["ffn"][0] == pytest.approx(share)
    assert results["cases"]["residual"][0] == pytest.approx(1 - share)
    assert results["cases"]["residual"][1] == pytest.approx(1.0)
    assert results["zero_agreement_rate"][0] == pytest.approx(1 - share)
    assert results["active_fraction"][0] == pytest.approx(share / 4)
    assert results["active_fraction"][1] == 0.0
    assert results["residual_matches_final"][0] == pytest.approx(1 - share)
    assert results["residual_matches_final"][1] == pytest.approx(1.0)
    assert torch.equal(passed.top_output[-1], passed.final_top)


def test_classify_covers_every_case():
    r = torch.tensor([1, 1, 1, 1, 1])
    y = torch.tensor([2, 1, 2, 2, 1])
    o = torch.tensor([1, 1, 2, 3, 4])
    assert [CASES[i] for i in classify(r, y, o)] == [
        "residual", "agreement", "ffn", "composition", "other"]


def test_zero_agreement_uses_the_coefficient_sign():
    top_plus, top_minus = torch.tensor([5, 6]), torch.tensor([7, 8])
    signs = torch.tensor([[1, 0], [-1, 0], [0, -1], [0, 0]], dtype=torch.int8)
    top_y = torch.tensor([5, 5, 8, 5])
    assert zero_agreement(top_y, signs, top_plus, top_minus).tolist() == [
        False, True, False, True]


def test_mixed_mlp_kinds_are_a_value_error():
    model = handset_model("gated")
    model.model.layers[1].mlp = ReLUMLP(12, 4)
    with pytest.raises(ValueError, match=r"mixed MLP kinds \['gated', 'relu'\]"):
        ffn_adapter(model)
