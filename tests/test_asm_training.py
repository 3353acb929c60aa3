"""ASM language-model training: the offline corpus, the tokenizer, the matched Transformer, the
training loop (resumable, same tokens for both models) and its bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from modeling.asm import ASMConfig, ASMForCausalLM
from modeling.asm.baseline_asm import count_parameters, matched_llama_config
from modeling.asm.corpus_asm import hub_corpus, kjv_corpus, pack_blocks, train_bpe_tokenizer
from modeling.asm.training_asm import LMTrainConfig, _precision, batch_order, evaluate_nll, train_lm


def tiny_config(**overrides) -> ASMConfig:
    base = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_slots=4, slot_space_dim=8, max_position_embeddings=16, chunk_size=8,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return ASMConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def corpus():
    return kjv_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_bpe_tokenizer(corpus["train"]["text"][:40], vocab_size=300)


def test_corpus_split_is_a_fixed_function_of_the_chapter(corpus):
    train = set(zip(corpus["train"]["book"], corpus["train"]["chapter"], strict=True))
    held = set(zip(corpus["validation"]["book"], corpus["validation"]["chapter"], strict=True))
    assert len(train) + len(held) == 1189 and not train & held
    assert 0.03 < len(held) / 1189 < 0.07
    again = kjv_corpus()
    assert again["validation"]["text"] == corpus["validation"]["text"]
    larger = kjv_corpus(0.2)
    larger_held = set(zip(larger["validation"]["book"], larger["validation"]["chapter"],
                          strict=True))
    assert held < larger_held  # raising the fraction only moves chapters into validation
    assert corpus["train"][0]["text"].startswith("In the beginning God created")


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_corpus_rejects_a_degenerate_split(fraction):
    with pytest.raises(ValueError, match="validation_fraction"):
        kjv_corpus(fraction)


@pytest.mark.parametrize("name", ["wikitext-103", "fineweb"])
def test_hub_corpora_say_offline_what_to_use_instead(name, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="offline, use kjv_corpus"):
        hub_corpus(name)


def test_an_unknown_hub_corpus_is_named():
    with pytest.raises(ValueError, match="unknown corpus 'wiki'"):
        hub_corpus("wiki")


def test_bpe_tokenizer_round_trips_and_loads_with_auto_tokenizer(tokenizer, tmp_path):
    text = "And God said, Let there be light: and there was light. Ünïcode — too."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 300 and tokenizer.eos_token_id == 0 == tokenizer.pad_token_id
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text).input_ids == ids and loaded.eos_token == "<|endoftext|>"


def test_bpe_tokenizer_is_deterministic(corpus, tokenizer):
    again = train_bpe_tokenizer(corpus["train"]["text"][:40], vocab_size=300)
    assert again.get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("size", [256, 0, True, 300.0])
def test_bpe_tokenizer_rejects_a_vocabulary_too_small(size):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["some text"], vocab_size=size)


def test_pack_blocks_keeps_document_order_with_eos_between(tokenizer):
    docs = ["In the beginning", "God created the heaven"]
    first, second = (tokenizer(d).input_ids for d in docs)
    stream = first + [0] + second + [0]
    blocks = pack_blocks(docs, tokenizer, 3)
    assert blocks.dtype == torch.int64 and blocks.shape == (len(stream) // 3, 3)
    assert blocks.flatten().tolist() == stream[:blocks.numel()]


def test_pack_blocks_errors_name_the_problem(tokenizer):
    with pytest.raises(ValueError, match="block_size"):
        pack_blocks(["text"], tokenizer, 1)
    with pytest.raises(ValueError, match="fewer than one block"):
        pack_blocks(["a"], tokenizer, 64)


@pytest.mark.parametrize("shape", [
    dict(),  # the tiny test model
    dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4),
    dict(vocab_size=50257, hidden_size=384, num_hidden_layers=21, num_attention_heads=8,
         num_slots=16, slot_space_dim=32),  # the paper's ASM-57M
], ids=["tiny", "cpu-run", "asm-57m"])
def test_matched_transformer_has_the_same_shape_and_parameter_count(shape):
    config = tiny_config(**shape)
    llama = matched_llama_config(config)
    with torch.device("meta"):
        asm_count = count_parameters(ASMForCausalLM(config))
        llama_count = count_parameters(LlamaForCausalLM(llama))
    assert abs(llama_count - asm_count) <= 0.05 * asm_count
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads,
            llama.vocab_size) == (config.hidden_size, config.num_hidden_layers,
                                  config.num_attention_heads, config.vocab_size)
    assert llama.tie_word_embeddings


def test_batch_order_visits_every_block_once_per_epoch_and_resumes():
    order = batch_order(10, 3, seed=5)
    steps = [next(order) for _ in range(7)]  # 3 per epoch: two epochs and one step
    for epoch in range(2):
        seen = torch.cat(steps[3 * epoch:3 * epoch + 3])
        assert len(set(seen.tolist())) == 9
    assert not torch.equal(torch.cat(steps[:3]), torch.cat(steps[3:6]))
    resumed = batch_order(10, 3, seed=5, first_step=5)
    for step in steps[4:]:
        assert torch.equal(next(resumed), step)
    with pytest.raises(ValueError, match="fewer than one batch"):
        next(batch_order(2, 3, seed=0))


def _blocks(count: int, length: int = 16, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # a learnable stream: token t+1 = token t + 1 (mod vocab) from a random start
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    return (start + torch.arange(length)) % vocab


def _train_config(**overrides) -> LMTrainConfig:
    base = dict(steps=6, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=3, save_every=3,
                progress=False, cpu=True)
    return LMTrainConfig(**{**base, **overrides})


@pytest.mark.parametrize("arch", ["asm", "transformer"])
def test_training_lowers_validation_loss(arch):
    torch.manual_seed(0)
    config = tiny_config()
    model = ASMForCausalLM(config) if arch == "asm" else LlamaForCausalLM(
        matched_llama_config(config))
    validation = _blocks(8, seed=1)
    before = evaluate_nll(model, validation)["nll"]
    log = train_lm(model, _blocks(64), validation, _train_config(steps=60, lr=1e-2))
    assert log["final"]["validation"]["nll"] < before - 1.0
    assert [entry["step"] for entry in log["history"]] == list(range(3, 61, 3))
    assert log["final"]["tokens"] == 60 * 4 * 16


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    import modeling.asm.training_asm as training

    def fresh():
        torch.manual_seed(0)
        return ASMForCausalLM(tiny_config())

    train, validation = _blocks(40), _blocks(4, seed=1)
    straight = fresh()
    train_lm(straight, train, validation, _train_config(), out=tmp_path / "straight")

    calls = {"n": 0}
    real = training.evaluate_nll

    def fail_on_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "evaluate_nll", fail_on_second)
    with pytest.raises(KeyboardInterrupt):
        train_lm(fresh(), train, validation, _train_config(), out=tmp_path / "resumed")
    saved = json.loads((tmp_path / "resumed" / "checkpoint" / "trainer_log.json").read_text())
    assert saved["step"] == 3 and not (tmp_path / "resumed" / "final").exists()
    monkeypatch.setattr(training, "evaluate_nll", real)
    other = fresh()
    with torch.no_grad():  # the weights must come from the checkpoint, not from here
        for parameter in other.parameters():
            parameter.add_(1.0)
    log = train_lm(other, train, validation, _train_config(), out=tmp_path / "resumed")
    for (name, a), b in zip(straight.state_dict().items(), other.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert [entry["step"] for entry in log["history"]] == [3, 6]
    reloaded = ASMForCausalLM.from_pretrained(tmp_path / "resumed" / "final")
    assert torch.equal(reloaded(_blocks(2)).logits, straight.eval()(_blocks(2)).logits)


def test_resuming_under_another_config_is_refused(tmp_path):
    torch.manual_seed(0)
    model = ASMForCausalLM(tiny_config())
    train_lm(model, _blocks(40), None, _train_config(steps=3), out=tmp_path)
    with pytest.raises(ValueError, match="another train_config"):
        train_lm(model, _blocks(40), None, _train_config(steps=3, lr=1e-2), out=tmp_path)
    train_lm(model, _blocks(40), None, _train_config(steps=3, lr=1e-2), out=tmp_path,
             resume=False)


@pytest.mark.parametrize("blocks, message", [
    (torch.zeros(4, 16), "int64"),
    (torch.zeros(4, dtype=torch.int64), "int64"),
    (torch.full((4, 16), 300), "outside"),
    (torch.full((4, 16), -1), "outside"),
], ids=["float", "1d", "id-too-large", "negative-id"])
def test_bad_blocks_are_refused(blocks, message):
    model = ASMForCausalLM(tiny_config())
    with pytest.raises(ValueError, match=message):
        train_lm(model, blocks, None, _train_config())


def test_a_diverging_loss_stops_training_with_a_clear_error():
    model = ASMForCausalLM(tiny_config())
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        train_lm(model, _blocks(40), None, _train_config())


@pytest.mark.parametrize("field, value", [
    ("steps", 0), ("batch_size", -1), ("lr", 0.0), ("lr", float("nan")), ("min_lr_ratio", 2.0),
    ("mixed_precision", "fp8"), ("eval_every", -1), ("grad_clip", 0),
])
def test_train_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LMTrainConfig.{field}"):
        LMTrainConfig(**{field: value})


def test_auto_precision_is_the_launch_flag_else_bf16_where_the_gpu_has_it(monkeypatch):
    """``accelerate launch --mixed_precision X`` sets ACCELERATE_MIXED_PRECISION: ``"auto"``
    follows it; an explicit config value wins over it; without a launch flag, no GPU: none."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert _precision("auto", cpu=True) == "bf16"
    assert _precision("no", cpu=True) == "no"
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert _precision("auto", cpu=True) == "no"
