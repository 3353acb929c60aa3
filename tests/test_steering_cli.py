"""``hf-memory bank|selector|chat|generate``: a user's own steering from the command line.

A tiny random Llama with the embedded model's tokenizer, saved as a folder, stands in for
``--model`` (the commands load it as they would any local model); the three-command flow on the
embedded model itself is timed in the README.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from hf_memory.banks.bank_set import BankSet
from hf_memory.recipes.persona import PersonaSteering
from hf_memory.selection.pairs import MIN_PAIRS, PairsFileError, read_pairs, write_pairs
from hf_memory.selection.selector import Selector
from hf_memory.steering.conversation import Conversation
from hf_memory_cli.main import main

from .tiny_models import tiny_model

PAIRS = [(f"Question number {i}?", f"Arr, matey, number {i} be fine.",
          f"Number {i} is fine.") for i in range(MIN_PAIRS)]


def _save_tiny(folder, tokenizer, seed):
    model = tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float32, seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_dirs(default_model, tmp_path_factory):
    """Two tiny models (different weights) as folders: the second is 'another model'."""
    _, tokenizer = default_model
    root = tmp_path_factory.mktemp("models")
    return _save_tiny(root / "a", tokenizer, 0), _save_tiny(root / "b", tokenizer, 1)


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_bank_build_adds_and_replaces_banks(tiny_dirs, tmp_path, capsys):
    model, out = tiny_dirs[0], str(tmp_path / "banks")
    code, text, _ = cli(capsys, "bank", "build", "--text", "You talk like a pirate.", "--out",
                        out, "--model", model)
    assert code == 0 and "persona (target)" in text
    (tmp_path / "reference.txt").write_text("You talk plainly.\n")
    assert cli(capsys, "bank", "build", "--file", str(tmp_path / "reference.txt"), "--role",
               "reference", "--out", out, "--model", model)[0] == 0
    banks = BankSet.from_pretrained(out)
    assert [(b.name, b.role) for b in banks] == [("persona", "target"),
                                                 ("reference", "reference")]
    assert banks["persona"].provenance["text"] == "You talk like a pirate."
    # a second target replaces the first; the reference stays
    assert cli(capsys, "bank", "build", "--text", "You talk like a poet.", "--out", out,
               "--model", model)[0] == 0
    banks = BankSet.from_pretrained(out)
    assert sorted(b.role for b in banks) == ["reference", "target"]
    assert banks["persona"].provenance["text"] == "You talk like a poet."
    assert banks["persona"].positions is None  # free slots by default


def test_bank_build_places_the_slots_before_the_conversation(tiny_dirs, tmp_path, capsys):
    from hf_memory.recipes.shipped import persona_bank
    from hf_memory_cli.model_loading import load_model

    model, out = tiny_dirs[0], str(tmp_path / "banks")
    assert cli(capsys, "bank", "build", "--text", "You talk like a pirate.", "--placement",
               "before", "--out", out, "--model", model)[0] == 0
    (bank,) = BankSet.from_pretrained(out)
    assert bank.provenance["placement"] == "before"
    loaded, tokenizer = load_model(model, None)
    expected = persona_bank(loaded, tokenizer, "You talk like a pirate.", placement="before")
    assert torch.equal(bank.positions, expected.positions) and bool((bank.positions < 0).all())
    with pytest.raises(SystemExit) as exit_:
        main(["bank", "build", "--text", "x", "--placement", "after", "--out",
              str(tmp_path / "other"), "--model", model])
    assert exit_.value.code == 2 and "invalid choice: 'after'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("args, message", [
    (["--text", "   "], "the bank text is empty"),
    (["--file", "/nonexistent/persona.txt"], "No such file"),
])
def test_bank_build_refuses_bad_text(tiny_dirs, tmp_path, capsys, args, message):
    code, _, err = cli(capsys, "bank", "build", *args, "--out", str(tmp_path / "b"), "--model",
                       tiny_dirs[0])
    assert code == 2 and message in err
    assert not (tmp_path / "b").exists()


def test_bank_build_keeps_a_folder_that_is_not_a_bank_set(tiny_dirs, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, "bank", "build", "--text", "x y", "--out", str(tmp_path),
                       "--model", tiny_dirs[0])
    assert code == 2 and "is not a bank set folder" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_pairs_file_errors_name_the_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    write_pairs(path, PAIRS)
    assert read_pairs(path) == PAIRS
    lines = path.read_text().splitlines()
    cases = [
        (lines[:3] + ["{not json"], "line 4: not JSON"),
        (lines[:2] + ['{"prompt": "p", "target": "t"}'], "line 3: expected an object"),
        (lines[:1] + ['{"prompt": "p", "target": "", "reference": "r"}'],
         "line 2: target must be non-empty"),
        (['{"prompt": "p", "target": "same", "reference": "same"}'], "line 1: the target and"),
        (lines[:MIN_PAIRS - 1], f"holds {MIN_PAIRS - 1} pairs; a selector needs at least "
                                f"{MIN_PAIRS}"),
    ]
    for content, message in cases:
        path.write_text("\n".join(content) + "\n")
        with pytest.raises(PairsFileError, match=message):
            read_pairs(path)


@pytest.mark.slow
def test_selector_pairs_then_calibrate(tiny_dirs, tmp_path, capsys):
    model, banks = tiny_dirs[0], str(tmp_path / "banks")
    cli(capsys, "bank", "build", "--text", "You talk like a pirate.", "--out", banks,
        "--model", model)
    code, text, _ = cli(capsys, "selector", "pairs", "--banks", banks, "--out",
                        str(tmp_path / "starter.jsonl"), "--count", "6", "--max-new-tokens",
                        "3", "--model", model)
    assert code == 0 and "edit them" in text
    starter = [json.loads(line) for line in (tmp_path / "starter.jsonl").read_text().splitlines()]
    assert starter and all(set(p) == {"prompt", "target", "reference"} for p in starter)
    assert all(p["target"] != p["reference"] for p in starter)
    # too few (6 asked) for calibration: the message says why
    code, _, err = cli(capsys, "selector", "calibrate", "--banks", banks, "--pairs",
                       str(tmp_path / "starter.jsonl"), "--out", str(tmp_path / "s"),
                       "--model", model)
    assert code == 2 and f"at least {MIN_PAIRS}" in err and "standard error" in err
    write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    code, text, _ = cli(capsys, "selector", "calibrate", "--banks", banks, "--pairs",
                        str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "s"),
                        "--top-layers", "1", "--candidate-layers", "0-1", "--layer-stride", "1",
                        "--workers", "1", "--model", model)
    assert code == 0 and "wrote" in text
    selector = Selector.from_pretrained(tmp_path / "s")
    assert set(selector.layers) <= {0, 1}
    assert selector.config["num_pairs"] == MIN_PAIRS


def test_generate_prints_json_lines(tiny_dirs, tmp_path, capsys):
    model, banks = tiny_dirs[0], str(tmp_path / "banks")
    cli(capsys, "bank", "build", "--text", "You talk like a pirate.", "--out", banks,
        "--model", model)
    (tmp_path / "prompts.txt").write_text('Hello there\n\n{"prompt": "How are you?"}\n')
    code, text, _ = cli(capsys, "generate", "--banks", banks, "--layers", "1", "--prompts",
                        str(tmp_path / "prompts.txt"), "--max-new-tokens", "4", "--model", model)
    records = [json.loads(line) for line in text.splitlines()]
    assert code == 0 and [r["prompt"] for r in records] == ["Hello there", "How are you?"]
    assert all(r["method"] == "memory" and r["strength"] == 1.0 for r in records)
    # strength 0 is the plain model exactly
    _, zero, _ = cli(capsys, "generate", "--banks", banks, "--layers", "1", "--strength", "0",
                     "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "4",
                     "--model", model)
    _, plain, _ = cli(capsys, "generate", "--prompts", str(tmp_path / "prompts.txt"),
                      "--max-new-tokens", "4", "--model", model)
    assert ([json.loads(line)["reply"] for line in zero.splitlines()]
            == [json.loads(line)["reply"] for line in plain.splitlines()])


@pytest.mark.parametrize("extra, message", [
    ([], "steering needs its sites"),
    (["--layers", "1", "--selector", "x"], "--selector or --layers, not both"),
])
def test_generate_refuses_missing_or_conflicting_sites(tiny_dirs, tmp_path, capsys, extra,
                                                       message):
    model, banks = tiny_dirs[0], str(tmp_path / "banks")
    cli(capsys, "bank", "build", "--text", "You talk like a pirate.", "--out", banks,
        "--model", model)
    code, _, err = cli(capsys, "generate", "--banks", banks, "--prompt", "hi", *extra,
                       "--model", model)
    assert code == 2 and message in err


def test_a_bank_for_another_model_is_refused(tiny_dirs, tmp_path, capsys):
    banks = str(tmp_path / "banks")
    cli(capsys, "bank", "build", "--text", "You talk like a pirate.", "--out", banks,
        "--model", tiny_dirs[0])
    code, _, err = cli(capsys, "generate", "--banks", banks, "--layers", "1", "--prompt", "hi",
                       "--model", tiny_dirs[1])
    assert code == 2 and "made for a different model" in err


def test_chat_keeps_one_conversation_through_slash_commands(tiny_dirs, tmp_path, capsys,
                                                            monkeypatch, default_model):
    model, banks = tiny_dirs[0], str(tmp_path / "banks")
    cli(capsys, "bank", "build", "--text", "You talk like a pirate.", "--out", banks,
        "--model", model)
    other = str(tmp_path / "other")
    cli(capsys, "bank", "build", "--text", "Only a test.", "--out", other, "--model",
        tiny_dirs[1])
    script = ["Hello there", "/strength 0.5", "/strength 7", "/bogus", f"/banks {other}",
              "/plain", "And now?", f"/save {tmp_path / 'chat.json'}", "/quit", "never sent"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(script) + "\n"))
    code, text, _ = cli(capsys, "chat", "--banks", banks, "--layers", "1", "--max-new-tokens",
                        "4", "--model", model)
    assert code == 0
    assert "strength 0.5" in text
    assert "# error: strength must be a number in [0, 1]" in text
    assert "# error: unknown command '/bogus' (nothing was sent)" in text
    assert "# error: this bank set was made for a different model" in text
    assert "# plain" in text
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 2
    assert saved["messages"][2]["content"] == "And now?" and saved["steering"] == "plain"
    # the first reply is the steered conversation's own (one cache, banks from the first turn)
    from hf_memory_cli.model_loading import load_model

    tiny, tokenizer = load_model(model)
    conversation = Conversation(tiny, tokenizer, banks=BankSet.from_pretrained(banks),
                                layers=[1])
    try:
        assert conversation.say("Hello there", max_new_tokens=4) == \
            saved["messages"][1]["content"]
    finally:
        conversation.close()


@pytest.mark.slow
def test_persona_calibrates_banks_and_selector_in_one_command(tiny_dirs, tmp_path, capsys):
    model, out = tiny_dirs[0], tmp_path / "pirate"
    write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    code, text, _ = cli(capsys, "persona", "--text", "You talk like a pirate.", "--pairs",
                        str(tmp_path / "pairs.jsonl"), "--out", str(out), "--top-layers", "1",
                        "--recipes", "prompt_like,descriptor", "--model", model)
    # the recipes screened by their best single layer, the better one searched fully
    assert code == 0 and ("# prompt_like: layers" in text) != ("# descriptor: layers" in text)
    assert "skipped, screened out: its best single layer scored" in text
    assert f"--selector {out / 'selector'}" in text
    # each trial's KV and factual cost; the replies judged by a judge fitted on the pairs
    assert "x the prompt's" in text and "nats/factual answer" in text
    assert "# replies to" in text and "#   memory: judged" in text
    found = PersonaSteering.from_pretrained(out)
    assert found.recipe in ("prompt_like", "descriptor") and len(found.trials) == 2
    assert found.trials[0]["recipe"] == found.recipe and "screened" in found.trials[1]
    assert found.selector.config["cost_budget"] == 0.1
    code, text, _ = cli(capsys, "generate", "--banks", str(out), "--selector",
                        str(out / "selector"), "--prompt", "Hi", "--max-new-tokens", "2",
                        "--model", model)
    assert code == 0 and json.loads(text.splitlines()[0])["method"] == "memory"


@pytest.mark.slow
def test_persona_with_a_voice_band_says_what_it_found_and_saves_what_it_kept(tiny_dirs, tmp_path,
                                                                           capsys):
    model, out = tiny_dirs[0], tmp_path / "voiced"
    write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    code, text, _ = cli(capsys, "persona", "--text", "You talk like a pirate.", "--pairs",
                        str(tmp_path / "pairs.jsonl"), "--out", str(out), "--top-layers", "1",
                        "--recipes", "prompt_like", "--voice", "--voice-budget", "10",
                        "--model", model)
    assert code == 0
    (line,) = [line for line in text.splitlines() if line.startswith("# voice band")]
    found = PersonaSteering.from_pretrained(out)
    voice = found.voice
    if "judged" in voice:
        assert f"judged {voice['judged']:.2f} against the sites' {voice['sites_judged']:.2f}" \
            in line and "(budget 10.000)" in line
        assert line.endswith("kept in their place" if voice["kept"] else "not kept")
        assert (found.selector.config.get("objective") == "voice_band") == voice["kept"]
    else:
        assert line.startswith("# voice band: none, ")
    code, text, _ = cli(capsys, "generate", "--banks", str(out), "--selector",
                        str(out / "selector"), "--prompt", "Hi", "--max-new-tokens", "2",
                        "--model", model)
    assert code == 0 and json.loads(text.splitlines()[0])["method"] == "memory"


def test_persona_refuses_bad_input(tiny_dirs, tmp_path, capsys):
    code, _, err = cli(capsys, "persona", "--text", "  ", "--out", str(tmp_path / "p"),
                       "--model", tiny_dirs[0])
    assert code == 2 and "persona text is empty" in err
    with pytest.raises(SystemExit) as exit_:
        main(["persona", "--text", "Arr.", "--recipes", "voice", "--out", str(tmp_path / "p")])
    assert exit_.value.code == 2 and "recipes must be among" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, "persona", "--text", "Arr.", "--out", str(tmp_path / "taken"),
                       "--model", tiny_dirs[0])
    assert code == 2 and "not a bank set folder" in err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    for flag, value in (("--kv-ceiling", "a quarter"), ("--kv-ceiling", "0"),
                        ("--capability-ceiling", "high")):
        with pytest.raises(SystemExit) as exit_:
            main(["persona", "--text", "Arr.", flag, value, "--out", str(tmp_path / "p")])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err
