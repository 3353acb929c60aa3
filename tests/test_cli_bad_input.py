"""Every ``hf-memory`` command, tried with malformed input: one clear error line, exit status 2,
no traceback, and nothing written."""

from __future__ import annotations

import json

import pytest
import torch

import hf_memory_cli as cli
from hf_memory import BankSet, MemoryBank

OUT = "{tmp}/out"

# (argv with {tmp} for the test's folder, a fragment the error line must contain)
BAD_INPUTS = [
    (["demo", "--max-new-tokens", "0"], "must be >= 1"),
    (["demo", "--gain", "nan"], "must be finite and >= 0"),
    (["demo", "--layers", "3-1"], "layers"),
    (["demo", "--prompt", "   "], "empty"),
    (["demo", "--selector", "{tmp}/missing"], "lacks selector.json"),
    (["demo", "--selector", "{tmp}/banks"], "lacks selector.json"),
    (["build-selector", "--direction", "X+"], "Big Five trait letter"),
    (["build-selector", "--top-layers", "0"], "must be >= 1"),
    (["build-selector", "--persona", "pirate", "--no-budget"],
     "always calibrated within a cost budget"),
    (["bank", "build", "--text", "   ", "--out", OUT], "the bank text is empty"),
    (["bank", "build", "--file", "{tmp}/missing.txt", "--out", OUT], "No such file"),
    (["bank", "build", "--text", "x", "--role", "boss", "--out", OUT], "invalid choice"),
    (["bank", "build", "--text", "a pirate", "--out", "{tmp}"], "is not a bank set folder"),
    (["selector", "calibrate", "--banks", "{tmp}/banks", "--pairs", "{tmp}/corrupt.json",
      "--out", OUT], "line 1: not JSON"),
    (["selector", "pairs", "--banks", "{tmp}/missing", "--out", OUT], "is not a saved bank set"),
    (["persona", "--text", "a pirate", "--pairs", "{tmp}/corrupt.json", "--out", OUT],
     "line 1: not JSON"),
    (["persona", "--text", "a pirate", "--out", "{tmp}"], "is not a bank set folder"),
    (["persona", "--text", "a pirate", "--recipes", "voice", "--out", OUT],
     "recipes must be among"),
    (["persona", "--text", "a pirate", "--workers", "0", "--out", OUT], "must be >= 1"),
    (["persona", "--text", "a pirate", "--voice", "--voice-budget", "lots", "--out", OUT],
     "lots"),
    (["chat", "--strength", "2"], "must be in [0, 1]"),
    (["chat", "--banks", "{tmp}/banks"], "steering needs its sites"),
    (["generate", "--prompt", " "], "give non-empty prompts"),
    (["generate", "--prompt", "hi", "--banks", "{tmp}/banks", "--layers", "0"],
     "the model has 3 of width 64"),
    (["playground", "--model", "{tmp}/missing"], "cannot load model"),
    (["analyze-ffn", "--sentences", "-5", "--out", OUT], "must be >= 1"),
    (["analyze-ffn", "--active-threshold", "1.5", "--out", OUT], "must be in [0, 1)"),
    (["analyze-ffn", "--layers", "-31", "--sentences", "4", "--out", OUT], "-31"),
    (["analyze-ffn", "--layers", "99", "--sentences", "4", "--out", OUT], "99"),
    (["air-train", "--out", OUT, "--lr", "nan"], "must be finite and > 0"),
    (["air-train", "--out", OUT, "--warmup-steps", "-1"], "must be >= 0"),
    (["air-train", "--out", OUT, "--eval-every", "0"], "must be >= 1"),
    (["air-train", "--out", OUT, "--ema-decay", "1"], "must be in [0, 1)"),
    (["air-train", "--out", OUT, "--injection", "bogus"], "injection"),
    (["air-train", "--out", OUT, "--size", "5"], "5"),
    (["air-train", "--out", OUT, "--heads", "3"], "heads"),
    (["air-report", "{tmp}/missing", "--out", OUT], "cannot draw the report"),
    (["asm-train", "--out", OUT, "--lr", "nan"], "must be finite and > 0"),
    (["asm-train", "--out", OUT, "--validation-fraction", "0"], "validation_fraction"),
    (["asm-train", "--out", OUT, "--tokenizer", "{tmp}/missing"], "cannot load the tokenizer"),
    (["asm-train", "--out", OUT, "--vocab-size", "100"], "vocab_size"),
    (["asm-train", "--out", OUT, "--heads", "3", "--vocab-size", "300"], "num_attention_heads"),
    (["asm-train", "--out", OUT, "--block-size", "1000000000", "--vocab-size", "300"],
     "fewer than one block"),
    (["arith-train", "--out", OUT, "--lr", "-1"], "must be finite and > 0"),
    (["arith-train", "--out", OUT, "--held-out-fraction", "1.5"], "must be in [0, 1)"),
    (["arith-train", "--out", OUT, "--checkpoint-every", "-2"], "must be >= 0"),
    (["arith-train", "--out", OUT, "--device", "bogus"], "not a torch device"),
    (["arith-report", "{tmp}/missing.json", "--out", OUT], "cannot draw the report"),
    (["arith-report", "{tmp}/corrupt.json", "--out", OUT], "cannot draw the report"),
    (["convert", "arith", "{tmp}/missing.pt", OUT], "no checkpoint at"),
    (["convert", "arith", "{tmp}/corrupt.json", OUT], "not a tensors-only PyTorch state dict"),
    (["convert", "arith", "{tmp}/tensor.pt", OUT], "not a state dict"),
    (["convert", "air", "{tmp}/tensor.pt", OUT], "needs --config"),
    (["convert", "air", "{tmp}/tensor.pt", OUT, "--config", "{tmp}/missing.yaml"],
     "cannot read the config"),
    (["eval", "bigfive", "--limit", "0", "--out", OUT], "between 1 and 10"),
    (["eval", "bigfive", "--gain", "inf", "--out", OUT], "must be finite and >= 0"),
    (["eval", "bigfive", "--caa-scale", "nan", "--out", OUT], "must be finite"),
    (["eval", "bigfive", "--traits", "X", "--out", OUT], "choose from"),
    (["eval", "trait-steering", "--calibration-pairs", "99", "--out", OUT], "between 1 and 24"),
    (["eval", "trait-steering", "--bootstrap", "0", "--out", OUT], "must be >= 1"),
    (["eval", "trait-steering", "--top-layers", "0", "--out", OUT], "must be >= 1"),
    (["eval", "trait-steering", "--cost-texts", "0", "--out", OUT], "must be >= 1"),
    (["eval", "trait-steering", "--validation", "1", "--out", OUT], "must be in [0, 1)"),
    (["eval", "trait-steering", "--judge-prompts", "-1", "--out", OUT], "must be >= 0"),
    (["eval", "trait-steering", "--caa-scales", "1,0", "--out", OUT], "expected numbers > 0"),
    (["eval", "trait-steering", "--caa-scales", "1,x", "--out", OUT],
     "expected comma-separated"),
    (["eval", "ffn-memories", "--layers", "40", "--out", OUT], "unknown layer index 40"),
    (["eval", "layer-ablation", "--caa-scales", "1", "--out", OUT],
     "--caa-scales is a trait-steering option, not layer-ablation's"),
    (["eval", "asm-refinement", "--betas", "0,-1", "--out", OUT],
     "expected finite non-negative numbers"),
    (["eval", "capability", "--memory-gains", "0.5", "--out", OUT], "include 1.0"),
    (["eval", "capability", "--additions", "0", "--out", OUT], "must be >= 1"),
    (["eval", "capability", "--capitals", "31", "--out", OUT],
     "capitals must be an integer from 0 to 30"),
    (["eval", "tradeoff", "--capitals", "-1", "--out", OUT], "must be >= 0"),
    (["eval", "lm-eval", "--tasks", "no_such_task", "--out", OUT],
     "lm-eval knows no task 'no_such_task'"),
    (["eval", "lm-eval", "--tasks", "hfm_capability_mc", "--banks", "{tmp}/banks", "--caa",
      "{tmp}/banks", "--out", OUT], "choose one steering: --banks and --caa"),
    (["eval", "persistence", "--lengths", "0,-5", "--out", OUT], "expected token counts"),
    (["eval", "capability", "--directions", "N+,Z-", "--out", OUT], "choose from"),
    (["eval", "dialogue-shift", "--transitions", "warm_to_anxious", "--out", OUT],
     "choose from"),
    (["eval", "dialogue-shift", "--turns", "8,12", "--out", OUT], "choose from"),
    (["eval", "dialogue-shift", "--cases", "{tmp}/corrupt.json", "--out", OUT],
     "is not valid JSON"),
    (["eval", "dialogue-shift", "--cases", "{tmp}/no_shift.json", "--out", OUT],
     "case mine: no shift turn"),
    (["eval", "dialogue-shift", "--styles", "{tmp}/styles.json", "--cases",
      "{tmp}/stern_case.json", "--out", OUT], "transition calm_to_stern has no calibration pairs"),
    (["eval", "dialogue-shift", "--styles", "{tmp}/styles.json", "--out", OUT],
     "--styles needs --cases"),
    (["eval", "guidance", "--rules", "one_word,haiku", "--out", OUT], "unknown rule 'haiku'"),
    (["eval", "guidance", "--rule-file", "{tmp}/no_examples.json", "--out", OUT],
     "rule 'haiku' has no examples"),
    (["eval", "guidance", "--rule-file", "{tmp}/corrupt.json", "--out", OUT],
     "is not valid JSON"),
    (["eval", "asm-refinement", "--model", "{tmp}/llama", "--out", OUT], "cannot load model"),
    (["eval", "kv-footprint", "--model", "{tmp}/missing", "--out", OUT], "cannot load model"),
    (["eval", "kv-footprint", "--model", "{tmp}/banks", "--out", OUT], "cannot load model"),
    (["eval", "bigfive", "--caa-layer", "99", "--limit", "1", "--out", OUT], "99"),
    (["caa", "extract", "--pairs", "{tmp}/corrupt.json", "--layers", "1", "--out", OUT],
     "line 1: not JSON"),
    (["caa", "extract", "--pairs", "{tmp}/corrupt.json", "--layers", "1", "--site", "mlp",
      "--out", OUT], "invalid choice"),
    (["caa", "export", "control-vector", "--vectors", "{tmp}/missing", "--out", OUT],
     "lacks config.json"),
    (["caa", "export", "lm-eval-steer", "--vectors", "{tmp}/missing.gguf", "--model",
      "{tmp}/llama", "--out", OUT], "cannot read"),
    (["export", "{tmp}/missing", OUT], "is not a folder"),
    (["export", "{tmp}/corrupt.json", OUT], "is not a folder"),
    (["export", "{tmp}", OUT], "holds no config.json"),
    (["export", "{tmp}/llama", OUT], "model_type 'llama'"),
    (["push", "{tmp}/banks", "no-slash", "--git-root", OUT], "org/name"),
    (["push", "{tmp}/missing", "org/x", "--git-root", OUT], "not a folder with files"),
    (["card", "{tmp}/banks", "--results", "{tmp}/missing.json"], "cannot read results"),
    (["card", "{tmp}/banks", "--results", "{tmp}/other.json"], "not a model"),
    (["report", "{tmp}/missing.json"], "cannot read results"),
    (["report", "{tmp}/corrupt.json"], "cannot read results"),
    (["report", "{tmp}/other.json"], "unknown task"),
]


@pytest.fixture
def inputs(tmp_path):
    """Malformed files beside the test's output folder (which must never be created)."""
    (tmp_path / "corrupt.json").write_text('{"task": "bigfive", "payl')
    (tmp_path / "other.json").write_text('{"a list": [1, 2, 3]}')
    (tmp_path / "no_examples.json").write_text(
        '{"rules": {"haiku": {"text": "Answer in a haiku.", "items": []}}}')
    calm = [{"question": f"Question {i}?", "calm": "Easy does it.", "cheerful": "Hooray!"}
            for i in range(4)]
    (tmp_path / "styles.json").write_text(json.dumps({
        "styles": {s: {"descriptor": f"I am {s}."} for s in ("calm", "cheerful", "stern")},
        "pairs": [{"pair": ["calm", "cheerful"], "calibration": calm}]}))
    (tmp_path / "stern_case.json").write_text(json.dumps([{
        "id": "mine", "root": "r", "family": "f", "branch": "a", "turns": 2, "old": "calm",
        "new": "stern", "shift_turn": 2, "user": ["a", "b"], "old_replies": ["c", "d"],
        "new_replies": ["e", "f"]}]))
    (tmp_path / "no_shift.json").write_text(
        '[{"id": "mine", "old": "warm", "new": "assertive", "turns": 2, "user": ["a", "b"]}]')
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    bank = MemoryBank.from_tensors(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), name="b",
                                   layers=(0,))
    BankSet([bank]).save_pretrained(tmp_path / "banks")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


def _ids(case):
    return "-".join(a for a in case[0][:3] if not a.startswith("{")).replace("--", "")


def _cases():
    """BAD_INPUTS as parameters; an unknown lm-eval task is ``slow`` (lm-eval indexes its whole
    task registry before it can refuse one: ~20 s)."""
    return [pytest.param(*case, id=_ids(case),
                         marks=[pytest.mark.slow] if "no_such_task" in case[0] else [])
            for case in BAD_INPUTS]


@pytest.mark.parametrize("argv, message", _cases())
def test_bad_input_is_one_line_and_writes_nothing(argv, message, inputs, capsys):
    before = sorted(p.relative_to(inputs) for p in inputs.rglob("*"))
    argv = [a.replace("{tmp}", str(inputs)) for a in argv]
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # argparse prints its usage before the error line
    assert "error:" in last and message in last, err
    assert sorted(p.relative_to(inputs) for p in inputs.rglob("*")) == before


def test_the_sweep_covers_every_command():
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {argv[0] for argv, _ in BAD_INPUTS}
