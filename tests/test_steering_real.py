"""The automatic path on the embedded SmolLM2-135M-Instruct: banks in context, the likelihood
probe, the prompt baseline's placements, the shipped frozen selectors and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from hf_memory import BankSet, FingerprintMismatchError, MemoryBank, PromptMethod, steer
from hf_memory.chat.generation import chat_messages, default_system_prompt, encode_chats
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.calibration_data import calibration_pairs, direction_parts
from hf_memory.recipes.demo import DEFAULT_PERSONA
from hf_memory.recipes.shipped import SHIPPED_DIRECTIONS, persona_bank, shipped_selector
from hf_memory.selection.selector import Selector, SelectorFormatError
from tests.test_memory_inception import random_bank
from tests.test_memory_inception_real import worry_margin
from tests.tiny_models import tiny_model

NEUTRAL = ("I read that the forecast calls for light rain this morning and clear skies by the "
           "evening.")
PROBE = [("How do you feel about your exam tomorrow?",
          "I'm really worried and nervous about it.", "I feel calm and relaxed about it."),
         ("Describe your morning in a sentence.",
          "I woke up tense, dreading the day.", "I woke up rested, enjoying the day.")]


@torch.no_grad()
def test_pair_margins_equal_one_pair_at_a_time(default_model):
    model, tokenizer = default_model
    batched = pair_margins(model, tokenizer, PROBE, batch_size=3)  # a batch splits a pair
    for (prompt, target, reference), margin in zip(PROBE, batched, strict=True):
        head = tokenizer.apply_chat_template(chat_messages(prompt), add_generation_prompt=True,
                                             tokenize=False)
        scores = []
        for reply in (target, reference):
            h = tokenizer(head, return_tensors="pt", add_special_tokens=False).input_ids
            r = tokenizer(reply, return_tensors="pt", add_special_tokens=False).input_ids
            logits = model(torch.cat([h, r], 1)).logits[0, h.shape[1] - 1:-1].log_softmax(-1)
            scores.append(logits.gather(-1, r[0, :, None]).double().sum())
        torch.testing.assert_close(margin, scores[0] - scores[1], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="three non-empty strings"):
        pair_margins(model, tokenizer, [("q", "a", "")])
    with pytest.raises(ValueError, match="non-empty sequence"):
        pair_margins(model, tokenizer, [])


def test_prompt_baseline_adds_to_the_default_system_prompt(default_model):
    _, tokenizer = default_model
    default = default_system_prompt(tokenizer)
    assert default.startswith("You are a helpful AI assistant named SmolLM")
    added = PromptMethod("I worry.", tokenizer=tokenizer).messages("Hi")
    assert added[0] == {"role": "system", "content": default + "\nI worry."}
    replaced = PromptMethod("I worry.", placement="replace_system").messages("Hi")
    assert replaced[0] == {"role": "system", "content": "I worry."}
    with pytest.raises(ValueError, match="needs the tokenizer"):
        PromptMethod("I worry.")


@torch.no_grad()
def test_an_in_context_bank_is_no_more_of_a_sink_than_its_visible_text(default_model):
    """No slot sits at position 0, and no slot draws attention by itself: on the last ten
    positions of neutral prompts, at every layer where no token of the same text takes 10 % of
    the attention when the text is visible in the system prompt, no slot takes 10 % either; where
    one does (SmolLM2 makes " the" a secondary sink in layers 3–10: up to 31 % visible, up to
    40 % as a canonical δ = 0 slot, measured), the bank's most-attended slot is that same token."""
    model, tokenizer = default_model
    prompts = ["What are your plans for this weekend?", "How was your day at work?"]
    bank = MemoryBank.from_text(model, tokenizer, NEUTRAL, template="{text}")
    assert min(bank.provenance["variants"][0]["kept_positions"]) > 0
    slots = [MemoryBank.from_tensors(bank.keys[:, :, m:m + 1], bank.values[:, :, m:m + 1],
                                     name=f"s{m}", role="auxiliary", layers=bank.layers,
                                     gain=0.0) for m in range(bank.num_slots)]
    batch = encode_chats(tokenizer, [chat_messages(p) for p in prompts])
    with steer(model, BankSet(slots, size_normalize=False), trace_only=True) as handle:
        handle.record_routing()
        model(**batch)
        routing = handle.routing()
    # the last 10 positions (the user's question and the assistant prefix) in both settings
    bank_share = torch.stack([routing[layer][0].mean(1)[:, -10:, 1:].mean((0, 1))
                              for layer in sorted(routing)])  # [layers, slots]
    system = default_system_prompt(tokenizer) + "\n" + NEUTRAL
    visible = encode_chats(tokenizer, [chat_messages(p, system=system) for p in prompts])
    text_start = len(tokenizer(tokenizer.apply_chat_template(
        [{"role": "system", "content": default_system_prompt(tokenizer) + "\n"}],
        tokenize=False).removesuffix("<|im_end|>\n"), add_special_tokens=False).input_ids)
    model.set_attn_implementation("eager")
    try:
        attentions = model(**visible, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    width = visible["attention_mask"].shape[1]
    n_text = len(tokenizer("\n" + NEUTRAL, add_special_tokens=False).input_ids) - 1
    columns = torch.stack([width - int(length) + text_start + torch.arange(n_text)
                           for length in visible["attention_mask"].sum(1)])  # [B, n_text]
    text_share = torch.stack([
        torch.stack([a.mean(1)[i, -10:, columns[i]].mean(0) for i in range(len(prompts))])
        .mean(0) for a in attentions])  # [layers, text tokens]
    variant = bank.provenance["variants"][0]
    bank_tokens = [variant["token_ids"][p] for p in variant["kept_positions"]]
    text_tokens = visible["input_ids"][0, columns[0]].tolist()
    own_sink = text_share.amax(-1) >= 0.1
    assert (bank_share.amax(-1)[~own_sink] < 0.1).all()
    assert own_sink.any()
    for layer in own_sink.nonzero().flatten().tolist():
        assert bank_tokens[int(bank_share[layer].argmax())] == text_tokens[
            int(text_share[layer].argmax())]


@pytest.mark.slow
def test_calibration_bad_input_is_one_clear_error(default_model):
    model, tokenizer = default_model
    pairs, drift = calibration_pairs("N+")
    foreign = BankSet([random_bank("t", "target", 3)], model=tiny_model("llama"))
    with pytest.raises(FingerprintMismatchError):
        Selector.calibrate_behavioural(model, tokenizer, foreign, pairs, progress=False)
    banks = BankSet([persona_bank(model, tokenizer, DEFAULT_PERSONA, layers=[20])], model=model)
    with pytest.raises(ValueError, match="non-empty sequence"):
        Selector.calibrate_behavioural(model, tokenizer, banks, [], progress=False)
    with pytest.raises(ValueError, match="Big Five trait letter"):
        direction_parts("X+")
    with pytest.raises(ValueError, match="no selector is shipped"):
        shipped_selector("X+")


def test_a_selector_of_another_format_version_is_refused(tmp_path):
    selector = shipped_selector("N+")
    selector.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "selector.json").read_text())
    record["format_version"] = 0
    (tmp_path / "selector.json").write_text(json.dumps(record))
    with pytest.raises(SelectorFormatError, match="not a version 1"):
        Selector.from_pretrained(tmp_path)


@pytest.mark.parametrize("direction", ["N+", "N-"])
@pytest.mark.slow
def test_the_automatic_path_moves_the_probe_towards_the_target(default_model, direction):
    """The shipped frozen selector, with the direction's descriptor bank: the worry probe moves
    towards the target (up for anxious, down for calm), and the opposite descriptor's bank at the
    same sites moves it the other way. (Within its cost budget memory no longer moves this probe
    as far as the visible prompt for N−: −3.6 against −7.6 nats; memory against the prompt is
    measured at matched cost by ``hf-memory eval tradeoff``, BENCHMARKS.md.)"""
    model, tokenizer = default_model
    _, sign, target, reference = direction_parts(direction)
    selector = shipped_selector(direction, model=model)
    assert selector.config["objective"] == "behavioural_budgeted"
    plain = worry_margin(model, tokenizer)
    banks = BankSet([persona_bank(model, tokenizer, target)], model=model)
    with steer(model, banks, selector=selector):
        memory = worry_margin(model, tokenizer)
    with steer(model, BankSet([persona_bank(model, tokenizer, reference)], model=model),
               selector=selector):
        opposite = worry_margin(model, tokenizer)
    prompt = worry_margin(model, tokenizer, PromptMethod(target, tokenizer=tokenizer))
    assert sign * (memory - plain) > 0, (plain, memory)
    assert sign * (prompt - plain) > 0, (plain, prompt)  # the probe itself points the right way
    assert sign * (opposite - plain) < 0, (plain, opposite)


def test_a_frozen_selector_is_shipped_for_every_direction(default_model):
    model, _ = default_model
    for direction in SHIPPED_DIRECTIONS:
        selector = shipped_selector(direction, model=model)
        assert selector.config["objective"] == "behavioural_budgeted"
        assert selector.config["direction"] == direction
        best = selector.config["best"]
        assert best["target"] > 0  # moves its calibration pairs its way, net of a neutral bank
        assert selector.config["cost_budget"] == 0.1
        assert selector.strength == best["strength"] > 0


@pytest.fixture(scope="module")
def neutral_cost(default_model):
    from hf_memory.metrics.steering_cost import NeutralCost

    return NeutralCost(*default_model)


# Measured 2026-12-06 (16 held-out items each): A+ moves them -0.24 nats, O- +0.07; the other
# eight +1.7 to +4.1. Strict: a selector rebuilt to move them makes these fail until unmarked.
WEAK_DIRECTIONS = {"A+": "its sites move the held-out items the wrong way (-0.24 nats)",
                   "O-": "its sites barely move the held-out items (+0.07 nats)"}


@pytest.mark.slow
@pytest.mark.parametrize("direction", [
    pytest.param(d, marks=pytest.mark.xfail(strict=True, reason=WEAK_DIRECTIONS[d]))
    if d in WEAK_DIRECTIONS else d for d in SHIPPED_DIRECTIONS])
def test_every_shipped_selector_is_within_its_budget_and_moves_its_held_out_items(
        default_model, neutral_cost, direction):
    """Measured afresh, not read back from the selector's record: the direction's cost on the
    shipped neutral text is within the 0.1 budget it was calibrated under, and its descriptor
    bank at its sites moves the trait's 16 held-out items its way by at least 1 nat on
    average."""
    from eval_harness.directions import eval_pairs
    from hf_memory.baselines.methods import MemoryMethod

    model, tokenizer = default_model
    trait, sign, target, _ = direction_parts(direction)
    selector = shipped_selector(direction, model=model)
    method = MemoryMethod(BankSet([persona_bank(model, tokenizer, target)], model=model),
                          selector)
    assert neutral_cost.measure(method) <= selector.config["cost_budget"] == 0.1
    pole, other = ("high", "low") if sign > 0 else ("low", "high")
    pairs = [(i["question"], i[pole], i[other]) for i in eval_pairs() if i["trait"] == trait]
    shift = pair_margins(model, tokenizer, pairs, method=method) - pair_margins(
        model, tokenizer, pairs)
    assert float(shift.mean()) >= 1.0, float(shift.mean())


@pytest.mark.slow
def test_the_shipped_persona_moves_the_replies_its_way_by_the_judge(default_model):
    """The pirate's greedy replies to the demo's prompts, judged by a judge fitted on its own
    pairs: its voice band (the memory meant to voice it, within the prompt's cost and KV) is
    judged more pirate than plain, and so is the visible prompt. The selector's few sites are
    not asked to: since the first token was kept off the banks they move the likelihood of the
    pirate replies and not their voice (measured 2026-12-07: plain 0.24, the selector's sites
    0.20, prompt 0.73)."""
    from hf_memory import MemoryMethod, PlainMethod
    from hf_memory.metrics.reply_judge import ReplyJudge, judge_methods
    from hf_memory.recipes.demo import DEFAULT_PROMPTS
    from hf_memory.recipes.persona import persona_banks
    from hf_memory.recipes.shipped import SHIPPED_PERSONAS, persona_spec

    model, tokenizer = default_model
    for name in SHIPPED_PERSONAS:
        spec = persona_spec(name)
        band = spec["band"]
        banks = persona_banks(model, tokenizer, spec["text"], recipe="prompt_like",
                              sink_reads_banks=False)
        judge = ReplyJudge.fit(spec["pairs"])  # refuses one under 0.8
        rows = judge_methods(model, tokenizer, judge, list(DEFAULT_PROMPTS),
                             {"plain": PlainMethod(),
                              "band": MemoryMethod(banks, layers=band["layers"],
                                                   layer_gains=dict.fromkeys(band["layers"],
                                                                             band["rho"])),
                              "prompt": PromptMethod(spec["text"], tokenizer=tokenizer)},
                             max_new_tokens=32)
        scores = {method: row["judge_score"] for method, row in rows.items()}
        assert scores["band"] > scores["plain"] and scores["prompt"] > scores["plain"], scores
