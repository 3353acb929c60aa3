"""The asm-refinement analysis (geometry, interventions, beta sweep, slots) against direct
computations, and the whole CPU pipeline: corpus -> tokenizer -> training -> analysis -> report."""

from __future__ import annotations

import json

import pytest
import torch

from eval_harness.asm_refinement.task import run_asm_refinement
from hf_memory_cli.main import main
from modeling.asm import ASMConfig, ASMForCausalLM
from modeling.asm.corpus_asm import kjv_corpus, pack_blocks, train_bpe_tokenizer
from modeling.asm.training_asm import evaluate_nll

CONTEXT = 16


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(kjv_corpus()["train"]["text"][:40], vocab_size=300)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = ASMConfig(vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                       num_slots=4, slot_space_dim=8, max_position_embeddings=CONTEXT,
                       chunk_size=8, refinement_gate_init=0.5, eos_token_id=0)
    return ASMForCausalLM(config).eval()


@pytest.fixture(scope="module")
def results(model, tokenizer):
    return run_asm_refinement(model, tokenizer, blocks=6, samples=10**6,
                              betas=(0.0, 0.5, 1.0, 2.0), batch_size=4)


@pytest.fixture(scope="module")
def blocks(tokenizer):
    return pack_blocks(kjv_corpus()["validation"]["text"], tokenizer, CONTEXT)[:6]


def test_nll_conditions_equal_direct_interventions(model, blocks, results):
    interventions = results["interventions"]
    assert interventions["nll"]["default"] == evaluate_nll(model, blocks, 4)["nll"]
    with model.refinement_intervention("none"):
        assert interventions["nll"]["none"] == evaluate_nll(model, blocks, 4)["nll"]
    with model.refinement_intervention("orthogonal_only", layers=[1]):
        assert interventions["per_layer"]["orthogonal_only"][1] == evaluate_nll(
            model, blocks, 4)["nll"]
    for mode, value in interventions["nll"].items():
        assert interventions["delta"][mode] == pytest.approx(
            value - interventions["nll"]["default"], abs=1e-12)
    sweep = {p["beta"]: p["nll"] for p in results["beta_sweep"]["points"]}
    assert sweep[1.0] == interventions["nll"]["default"]  # beta = 1 is the unmodified model
    assert results["beta_sweep"]["best_nll"] == min(sweep.values())
    assert interventions["nll"]["orthogonal_only"] != interventions["nll"]["default"]


def test_geometry_is_the_models_own_statistics(model, blocks, results):
    with torch.no_grad():
        stats = model(input_ids=blocks, output_refinement_stats=True).refinement_stats
    alpha = [s.alpha.flatten() for s in stats]
    assert results["geometry"]["alpha"]["samples"] == sum(a.numel() for a in alpha)
    assert results["geometry"]["alpha"]["median"] == pytest.approx(
        float(torch.cat(alpha).median()))
    assert results["geometry"]["alpha"]["median_per_layer"] == pytest.approx(
        [float(a.median()) for a in alpha])
    fraction = results["geometry"]["orthogonal_fraction"]
    assert 0 <= fraction["quantiles"]["p5"] <= fraction["median"] <= fraction["quantiles"]["p95"]
    assert sum(fraction["histogram"]["counts"]) == fraction["samples"]
    ess = [float(s.slot_ess.mean()) for s in stats]
    assert results["slots"]["ess_per_layer"] == pytest.approx(ess)
    assert all(1.0 <= e <= 4.0 for e in ess)
    inertia = torch.stack([s.routing_inertia.double().mean(0) for s in stats])
    measured = torch.tensor(results["heads"]["routing_inertia"], dtype=torch.float64)
    assert torch.allclose(measured, inertia)


def test_claims_follow_the_measured_numbers(results):
    claims, nll = results["claims"], results["interventions"]["nll"]
    assert claims["alpha_median_negative"] == (results["geometry"]["alpha"]["median"] < 0)
    assert claims["orthogonal_only_worse_than_parallel_only"] == (
        nll["orthogonal_only"] > nll["parallel_only"])
    per_layer = results["interventions"]["per_layer"]["orthogonal_only"]
    assert claims["orthogonal_only_hurts_layer_0_most"] == (per_layer[0] == max(per_layer))
    ess = results["slots"]["ess_per_layer"]
    assert claims["ess_u_shaped"] == (ess[1] < min(ess[0], ess[2]))
    sweep = {p["beta"]: p["nll"] for p in results["beta_sweep"]["points"]}
    assert claims["small_beta_at_least_as_good_as_zero"] == (
        min(sweep[0.5], sweep[1.0]) <= sweep[0.0])


def test_bad_requests_are_refused(tokenizer):
    config = ASMConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_slots=4, slot_space_dim=8, max_position_embeddings=CONTEXT,
                       use_slot_space_refinement=False)
    with pytest.raises(ValueError, match="use_slot_space_refinement"):
        run_asm_refinement(ASMForCausalLM(config), tokenizer, blocks=2)
    config = ASMConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_slots=4, slot_space_dim=8, max_position_embeddings=CONTEXT)
    with pytest.raises(ValueError, match="at least one beta"):
        run_asm_refinement(ASMForCausalLM(config), tokenizer, blocks=2, betas=())


@pytest.mark.slow
def test_cpu_pipeline_trains_both_models_and_reports(tmp_path, capsys):
    """What CI runs: corpus -> BPE -> a few steps of ASM and of its matched Transformer ->
    asm-refinement -> report, through the command line."""
    asm, llama = tmp_path / "asm", tmp_path / "llama"
    shape = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--slots", "4",
             "--slot-space-dim", "8", "--block-size", "32", "--steps", "4", "--batch-size", "4",
             "--eval-every", "2", "--save-every", "2", "--warmup-steps", "1"]
    assert main(["asm-train", "--out", str(asm), "--vocab-size", "300", *shape]) == 0
    assert main(["asm-train", "--arch", "transformer", "--tokenizer", str(asm / "tokenizer"),
                 "--out", str(llama), *shape]) == 0
    printed = capsys.readouterr().out
    assert "ASMForCausalLM" in printed and "LlamaForCausalLM" in printed
    logs = [json.loads((run / "log.json").read_text()) for run in (asm, llama)]
    assert abs(logs[1]["num_parameters"] - logs[0]["num_parameters"]) <= (
        0.05 * logs[0]["num_parameters"])
    assert logs[0]["final"]["validation"]["tokens"] == logs[1]["final"]["validation"]["tokens"]
    report = tmp_path / "analysis"
    assert main(["eval", "asm-refinement", "--model", str(asm / "final"), "--blocks", "4",
                 "--samples", "500", "--betas", "0,0.5,1", "--out", str(report)]) == 0
    for name in ("results.json", "report.md", "geometry.png", "interventions.png",
                 "beta_sweep.png", "slots.png"):
        assert (report / name).stat().st_size > 0, name
    record = json.loads((report / "results.json").read_text())
    assert record["task"] == "asm-refinement" and record["results"]["blocks"] == 4
    assert "## The paper's claims, as measured" in (report / "report.md").read_text()
    assert main(["eval", "asm-refinement", "--model", str(llama / "final"),
                 "--out", str(tmp_path / "bad")]) == 2
    assert "needs an asm model" in capsys.readouterr().err
