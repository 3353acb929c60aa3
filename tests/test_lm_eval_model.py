"""The ``hf-memory`` model type of lm-evaluation-harness on the embedded SmolLM2: its
log-likelihoods under every steering equal ``hf_memory.metrics.likelihood``'s on the same items,
our CAA
through it equals lm-eval's own ``steered`` model given the same vector at the same hook point,
the offline tasks run end to end into our results schema, and bad input fails with one clear
error."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.hf_steered import SteeredModel  # noqa: E402

from eval_harness.lm_eval_model.model import HFMemoryLM  # noqa: E402
from hf_memory import BankSet, CAAVectors, apply_caa, export_lm_eval_steer  # noqa: E402
from hf_memory.baselines.methods import MemoryMethod, PromptMethod  # noqa: E402
from hf_memory.chat.generation import chat_messages  # noqa: E402
from hf_memory.metrics.likelihood import reply_logprobs  # noqa: E402
from hf_memory.recipes.demo import shipped_selector  # noqa: E402
from hf_memory.recipes.shipped import persona_bank

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

QUESTIONS = ("How do you spend a free evening?", "What do you do when plans change?")
REPLIES = ("I stay home and read quietly.", "I call friends and go out dancing!")
CAA_LAYER, CAA_SCALE = 10, 4.0
PROMPT = "You are extremely anxious and worried."


@pytest.fixture(scope="module")
def steering(default_model):
    model, tokenizer = default_model
    banks = BankSet([persona_bank(model, tokenizer, PROMPT)], model=model)
    vectors = CAAVectors.extract(model, tokenizer, [(PROMPT, "You are calm and relaxed.")],
                                 layers=[CAA_LAYER], scale=CAA_SCALE)
    return {"banks": banks, "selector": shipped_selector("N+", model), "caa": vectors}


def _lm(default_model, batch_size: int = 3, **kwargs) -> HFMemoryLM:
    model, tokenizer = default_model
    return HFMemoryLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)


def _requests(lm, questions=QUESTIONS, replies=REPLIES) -> tuple[list, list]:
    """(context, reply) and (context, its trailing newline) for every question × reply: lm-eval
    moves the context's trailing whitespace into the continuation, so the reply's own
    log-likelihood is the difference of the two."""
    heads = [lm.apply_chat_template(chat_messages(q)) for q in questions]
    assert all(h.endswith("\n") for h in heads)
    pairs = [(h, r) for h in heads for r in replies]
    full = [Instance("loglikelihood", {}, (h, r), i) for i, (h, r) in enumerate(pairs)]
    newline = [Instance("loglikelihood", {}, (h[:-1], "\n"), i) for i, (h, _) in enumerate(pairs)]
    return full, newline


def _lm_eval_replies(lm) -> torch.Tensor:
    full, newline = _requests(lm)
    with_reply = torch.tensor([ll for ll, _ in lm.loglikelihood(full)], dtype=torch.float64)
    return with_reply - torch.tensor([ll for ll, _ in lm.loglikelihood(newline)],
                                     dtype=torch.float64)


def _reference(default_model, messages=chat_messages, method=None) -> torch.Tensor:
    model, tokenizer = default_model
    conversations = [messages(q) for q in QUESTIONS for _ in REPLIES]
    replies = [r for _ in QUESTIONS for r in REPLIES]
    return reply_logprobs(model, tokenizer, conversations, replies, method=method, batch_size=4)


def test_plain_loglikelihoods_equal_hf_memory_likelihood(default_model):
    torch.testing.assert_close(_lm_eval_replies(_lm(default_model)),
                               _reference(default_model), rtol=0, atol=2e-4)


def test_memory_loglikelihoods_equal_hf_memory_likelihood(default_model, steering):
    lm = _lm(default_model, banks=steering["banks"], selector=steering["selector"])
    ours = _lm_eval_replies(lm)
    reference = _reference(default_model, method=MemoryMethod(steering["banks"],
                                                              steering["selector"]))
    torch.testing.assert_close(ours, reference, rtol=0, atol=2e-4)
    assert (ours - _reference(default_model)).abs().max() > 1e-2  # the banks do steer


def test_caa_loglikelihoods_equal_hf_memory_likelihood(default_model, steering):
    model, _ = default_model
    ours = _lm_eval_replies(_lm(default_model, caa=steering["caa"]))
    with apply_caa(model, steering["caa"]):  # every position, as lm-eval has no instruction end
        reference = _reference(default_model)
    torch.testing.assert_close(ours, reference, rtol=0, atol=2e-4)
    assert (ours - _reference(default_model)).abs().max() > 1e-2


def test_prompt_loglikelihoods_equal_hf_memory_likelihood(default_model):
    model, tokenizer = default_model
    ours = _lm_eval_replies(_lm(default_model, prompt=PROMPT))
    method = PromptMethod(PROMPT, tokenizer=tokenizer)
    torch.testing.assert_close(ours, _reference(default_model, messages=method.messages),
                               rtol=0, atol=2e-4)


def test_memory_rolling_and_generation_equal_the_steered_model(default_model, steering):
    """``loglikelihood_rolling`` and ``generate_until`` under banks: what the model computes
    inside ``hf_memory.steer`` (a forward pass; ``generate()``) on the same tokens."""
    from hf_memory import steer
    from hf_memory.metrics.likelihood import log_probabilities

    model, tokenizer = default_model
    lm = _lm(default_model, batch_size=1, banks=steering["banks"],
             selector=steering["selector"])
    texts = [f"{q} {r}" for q in QUESTIONS for r in REPLIES]
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i)
                                        for i, t in enumerate(texts)])
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS]
    until = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    generated = lm.generate_until([Instance("generate_until", {}, (p, dict(until)), i)
                                   for i, p in enumerate(prompts)])
    sums, replies = [], []
    with steer(model, steering["banks"], selector=steering["selector"]), torch.no_grad():
        for text in texts:
            ids = torch.tensor([[lm.prefix_token_id, *lm.tok_encode(text)]])
            picked = log_probabilities(model(ids).logits)[0, :-1].gather(-1, ids[0, 1:, None])
            sums.append(picked.double().sum().item())
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
            replies.append(tokenizer.decode(out[0, ids.shape[1]:],
                                            skip_special_tokens=True).split("\n")[0])
    torch.testing.assert_close(torch.tensor(rolling, dtype=torch.float64),
                               torch.tensor(sums, dtype=torch.float64), rtol=0, atol=2e-4)
    assert generated == replies


@pytest.mark.slow
def test_our_caa_equals_lm_evals_steered_model(default_model, steering, tmp_path):
    """lm-eval's ``steered`` type adds ``coefficient · vector`` to a module's output through
    its own hooks; the file :func:`export_lm_eval_steer` writes from our vectors names
    ``layers.L.self_attn``, where our CAA writes (a pre-norm Llama)."""
    model, tokenizer = default_model
    path = export_lm_eval_steer(steering["caa"], model, tmp_path / "steer.pt")
    assert list(torch.load(path, weights_only=True)) == [f"layers.{CAA_LAYER}.self_attn"]
    theirs = SteeredModel(pretrained=model, tokenizer=tokenizer, steer_path=str(path),
                          batch_size=3)
    ours = _lm(default_model, caa=steering["caa"])
    full, _ = _requests(ours)
    assert ([ll for ll, _ in ours.loglikelihood(full)]
            == [ll for ll, _ in theirs.loglikelihood(full)])
    rolling = [Instance("loglikelihood_rolling", {}, (f"{q} {r}",), 0)
               for q in QUESTIONS for r in REPLIES]
    assert ours.loglikelihood_rolling(rolling) == theirs.loglikelihood_rolling(rolling)
    generate = [Instance("generate_until", {}, (f"Question: {q}\nAnswer:",
                                                {"until": ["\n"], "max_gen_toks": 6}), 0)
                for q in QUESTIONS]
    assert ours.generate_until(generate) == theirs.generate_until(generate)


@pytest.mark.slow
def test_simple_evaluate_runs_the_offline_tasks_into_our_schema(default_model, steering,
                                                                 tmp_path):
    from eval_harness.lm_eval_model.task import run_lm_eval
    from eval_harness.report import render_report
    from eval_harness.runner import run_task

    model, _ = default_model
    lm = _lm(default_model, banks=steering["banks"], selector=steering["selector"])
    tasks = ["hfm_capability_mc", "hfm_capability_gen", "hfm_trait_pairs"]
    path = run_task("lm-eval", lambda: run_lm_eval(lm, tasks, limit=3), model=model,
                    config={"tasks": tasks, "limit": 3}, seed=0, out=tmp_path)
    record = json.loads(path.read_text())
    assert set(record["results"]["results"]) == set(tasks)
    assert record["results"]["steering"]["method"] == "memory"
    assert {b["content_hash"] for b in record["results"]["steering"]["banks"]} == {
        b.content_hash() for b in steering["banks"].banks}
    assert 0 <= record["results"]["metrics"]["hfm_capability_mc/acc"] <= 1
    assert "hfm_capability_gen/exact_match:last_answer" in record["results"]["metrics"]
    assert {p.name for p in render_report(path)} == {"report.md", "lm_eval.png"}


def test_conflicting_steering_is_one_clear_error(default_model, steering):
    with pytest.raises(ValueError, match="choose one steering: banks and caa"):
        _lm(default_model, banks=steering["banks"], selector=steering["selector"],
            caa=steering["caa"])
    with pytest.raises(ValueError, match="banks need a selector"):
        _lm(default_model, banks=steering["banks"])
    with pytest.raises(ValueError, match="scale is the CAA"):
        _lm(default_model, scale=2.0)


def test_banks_of_another_model_are_refused(default_model, steering, tmp_path):
    from hf_memory import FingerprintMismatchError
    from tests.tiny_models import tiny_model

    steering["banks"].save_pretrained(tmp_path / "banks")
    steering["selector"].save_pretrained(tmp_path / "selector")
    other = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(FingerprintMismatchError, match="made for a different model"):
        HFMemoryLM(pretrained=other, tokenizer=default_model[1], banks=str(tmp_path / "banks"),
                   selector=str(tmp_path / "selector"))


@pytest.mark.slow
def test_unknown_task_is_one_clear_error():
    from eval_harness.lm_eval_model.task import check_tasks

    with pytest.raises(ValueError, match="lm-eval knows no task 'no_such_task'"):
        check_tasks(["hfm_capability_mc", "no_such_task"])


@pytest.mark.slow
def test_the_task_index_is_kept_until_a_users_task_folder_changes(tmp_path):
    from eval_harness.lm_eval_model.task import check_tasks

    assert check_tasks(["hfm_local"]) is check_tasks(["hfm_trait_pairs"])
    folder = tmp_path / "tasks"
    folder.mkdir()
    group = folder / "my_group.yaml"
    group.write_text("group: my_group\ntask:\n  - hfm_trait_pairs\n")
    first = check_tasks(["my_group"], [str(folder)])
    assert check_tasks(["my_group"], [str(folder)]) is first
    (folder / "my_other_group.yaml").write_text("group: my_other_group\ntask:\n  - hfm_local\n")
    rebuilt = check_tasks(["my_other_group"], [str(folder)])  # the new file is in the index
    assert rebuilt is not first and check_tasks(["my_group"], [str(folder)]) is rebuilt


@pytest.mark.slow
def test_the_command_line_runs_lm_eval_steered_and_reports(default_model, steering, tmp_path,
                                                           capsys):
    import hf_memory_cli as cli
    from eval_harness.family.task import family_fingerprint
    from hub_cards.results_card import render_results_card

    steering["caa"].save_pretrained(tmp_path / "caa")
    out = tmp_path / "out"
    assert cli.main(["eval", "lm-eval", "--tasks", "hfm_trait_pairs", "--docs", "2", "--caa",
                     str(tmp_path / "caa"), "--scale", "2", "--out", str(out)]) in (0, None)
    record = json.loads((out / "results.json").read_text())
    assert record["task"] == "lm-eval" and record["config"]["scale"] == 2.0
    assert record["results"]["steering"]["scale"] == 2.0
    assert record["results"]["samples"] == {"hfm_trait_pairs": 2}
    assert "Steering: CAA at layers [10], scale 2.0" in capsys.readouterr().out
    assert cli.main(["report", str(out)]) in (0, None)
    card = render_results_card(tmp_path, [record], family_fingerprint(default_model[0]))
    assert "hfm_trait_pairs/acc" in card
    assert "hf-memory eval lm-eval --model default --tasks hfm_trait_pairs --docs 2" in card
