"""LoRA fine-tuning of ASMForCausalLM with peft: only the adapters train, adapters save and load
exactly, merging keeps the logits, and generation through the PeftModel uses the ASM cache."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from hf_memory.models.transformers_compat import output_cache  # noqa: E402
from modeling.asm import ASMCache, ASMConfig, ASMForCausalLM  # noqa: E402

VOCAB = 61
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["up_proj", "down_proj"]
SLOT_SPACE = ["slot_in", "slot_q", "slot_k", "slot_v", "slot_out"]
# peft 0.21 asks every transformers model for `is_gradient_checkpointing`, which transformers 5
# deprecates: not ours to fix.
pytestmark = [pytest.mark.compat, pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]


def tiny_model() -> ASMForCausalLM:
    """Seeded tiny base model: the same call always gives the same weights."""
    torch.manual_seed(0)
    config = ASMConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2,
                       num_attention_heads=3, num_slots=5, slot_space_dim=6, chunk_size=4,
                       refinement_gate_init=0.0, content_read_init=0.0, pad_token_id=0,
                       initializer_range=0.3)
    model = ASMForCausalLM(config).eval()
    with torch.no_grad():  # make the slot keys and refinement matter at this tiny size
        for layer in model.model.layers:
            layer.self_attn.slot_keys.mul_(4.0)
    return model


def lora(targets: list[str], random_init: bool = False, seed: int = 1):
    """A LoRA PeftModel on a fresh tiny base. ``random_init``: B is random instead of zero, so
    the adapter changes the output without training."""
    base = tiny_model()
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM",
                        init_lora_weights=not random_init)
    return get_peft_model(base, config).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    ids = torch.randint(1, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # row 1 left-padded
    return ids, mask


def test_every_documented_target_module_gets_an_adapter():
    model = lora(ATTENTION + MLP + SLOT_SPACE, random_init=True)
    targeted = {name.rsplit(".", 1)[-1] for name in model.targeted_module_names}
    assert targeted == set(ATTENTION + MLP + SLOT_SPACE)
    n_layers = model.config.num_hidden_layers
    assert len(model.targeted_module_names) == n_layers * len(ATTENTION + MLP + SLOT_SPACE)
    ids, mask = batch()
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.requires_grad == ("lora_" in name), name
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_lora_training_lowers_the_loss_and_only_changes_the_adapters():
    model = lora(["q_proj", "v_proj", "o_proj"]).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(
        ("lora_" in name) == p.requires_grad for name, p in model.named_parameters())
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"base weight {name} changed"


def test_adapter_save_and_load_onto_a_fresh_base_is_exact(tmp_path):
    model = lora(["q_proj", "v_proj", "o_proj"], random_init=True)
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        base_logits = tiny_model()(ids, attention_mask=mask).logits
    assert not torch.allclose(expected, base_logits)  # the adapter matters
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(tiny_model(), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits, expected)


def test_merge_and_unload_keeps_the_logits():
    model = lora(ATTENTION + MLP + SLOT_SPACE, random_init=True)
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        merged = model.merge_and_unload()
        assert type(merged) is ASMForCausalLM
        assert not any("lora_" in name for name, _ in merged.named_parameters())
        torch.testing.assert_close(merged(ids, attention_mask=mask).logits, expected,
                                   rtol=1e-5, atol=1e-5)


def test_generate_through_the_peft_model_uses_the_cache_and_equals_merged_greedy():
    model = lora(["q_proj", "v_proj", "o_proj"], random_init=True)
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(input_ids=ids, use_cache=True, return_dict_in_generate=True, **kwargs)
    assert isinstance(output_cache(out), ASMCache)
    assert output_cache(out).get_seq_length() == ids.shape[1] + 9
    merged = model.merge_and_unload()
    manual, manual_mask = ids.clone(), mask.clone()
    with torch.no_grad():
        for _ in range(10):
            logits = merged(manual, attention_mask=manual_mask, use_cache=False).logits
            nxt = logits[:, -1].argmax(-1)
            manual = torch.cat([manual, nxt[:, None]], dim=1)
            manual_mask = torch.cat([manual_mask, torch.ones_like(nxt[:, None])], dim=1)
    assert torch.equal(out.sequences, manual)
    assert torch.equal(merged.generate(ids, use_cache=True, **kwargs), manual)
