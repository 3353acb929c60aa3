"""AIRSolver: schedule, one-step gradient, injections, level tokens, ACT, stablemax, freezing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from modeling.air import AIRConfig, AIRSolver
from modeling.air.configuration_air import INJECTION_VARIANTS, parse_injection
from modeling.air.modeling_air import (
    log_stablemax,
    stablemax_cross_entropy,
    variance_corrected_trunc_normal_,
)
from tests.remote_code import assert_remote_code_load_is_exact

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

VOCAB, SEQ = 6, 16


def tiny(**overrides) -> AIRSolver:
    fields = dict(vocab_size=VOCAB, seq_len=SEQ, hidden_size=16, num_hidden_layers=2,
                  num_attention_heads=2, halt_max_steps=4)
    fields.update(overrides)
    torch.manual_seed(0)
    model = AIRSolver(AIRConfig(**fields)).double()
    with torch.no_grad():  # non-zero puzzle embedding and level tokens (both start at zero),
        if model.puzzle_emb is not None:  # so the checks see them
            model.puzzle_emb.weight.normal_()
        if model.level_emb is not None:
            model.level_emb.normal_()
    return model


def batch(rows: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    labels = torch.randint(2, VOCAB, (rows, SEQ), generator=generator)
    return ids, labels


class BlockRecorder:
    """Records, for every call of the given blocks, the update level, whether grad was enabled,
    the block's input and its output."""

    def __init__(self, *blocks) -> None:
        self.calls: list[dict] = []
        self.handles = []
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post, with_kwargs=True))

    def _pre(self, module, args, kwargs):
        self.calls.append({"level": kwargs["level"], "grad": torch.is_grad_enabled(),
                           "input": args[0].detach().clone(), "block": module})

    def _post(self, module, args, kwargs, output):
        self.calls[-1]["output"] = output[0].detach().clone()

    @property
    def levels(self) -> list[str]:
        return [call["level"] for call in self.calls]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ----------------------------------------------------------------------------- config
def test_injection_names_parse_to_the_papers_counts():
    expected = {"L_Hx": (0, 1), "Lx_H": (1, 0), "L_H2x": (0, 2), "L2x_H": (2, 0),
                "Lx_H2x": (1, 2), "L2x_Hx": (2, 1), "Lx_Hx": (1, 1), "L2x_H2x": (2, 2)}
    assert {name: parse_injection(name) for name in INJECTION_VARIANTS} == expected


@pytest.mark.parametrize("field, value, needle", [
    ("injection", "LH", "injection"),
    ("level_token", "prefix", "level_token"),
    ("input_operator", "mul", "input_operator"),
    ("loss_type", "hinge", "loss_type"),
    ("hidden_size", 15, "hidden_size"),
    ("H_cycles", 0, "H_cycles"),
    ("halt_exploration_prob", 1.5, "halt_exploration_prob"),
    ("share_weights", "yes", "share_weights"),
])
def test_config_rejects_bad_fields_by_name(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        AIRConfig(**{field: value})


def test_single_state_refuses_level_tokens_and_two_networks():
    with pytest.raises(ValueError, match="single_state"):
        AIRConfig(single_state=True, level_token="prepend_strip")
    with pytest.raises(ValueError, match="single_state"):
        AIRConfig(single_state=True, share_weights=False)


def test_bad_inputs_name_the_problem():
    model = tiny().eval()
    ids, _ = batch()
    with pytest.raises(ValueError, match="seq_len"):
        model(ids[:, :-1])
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.full_like(ids, VOCAB))
    with pytest.raises(ValueError, match="num_puzzle_identifiers"):
        model(ids, puzzle_identifiers=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :4])
    with pytest.raises(ValueError, match="freeze_state"):
        model(ids, freeze_state="Z")


# ----------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("H_cycles, L_cycles, expected", [
    (2, 2, ["L", "L", "H", "L", "L", "H"]),
    (3, 1, ["L", "H", "L", "H", "L", "H"]),
    (1, 3, ["L", "L", "L", "H"]),
])
def test_a_recording_block_sees_the_sub_step_pattern(H_cycles, L_cycles, expected):
    model = tiny(H_cycles=H_cycles, L_cycles=L_cycles).eval()
    recorder = BlockRecorder(model.block)
    output = model(*batch())
    assert recorder.levels == expected
    assert list(output.sub_steps) == expected


def test_two_network_baseline_routes_each_update_to_its_own_block():
    model = tiny(share_weights=False).eval()
    recorder = BlockRecorder(model.L_block, model.H_block)
    model(*batch())
    assert recorder.levels == ["L", "L", "H", "L", "L", "H"]
    assert all(call["block"] is (model.L_block if call["level"] == "L" else model.H_block)
               for call in recorder.calls)
    shared = sum(p.numel() for p in tiny().parameters())
    separate = sum(p.numel() for p in model.parameters())
    assert separate - shared == sum(p.numel() for p in model.H_block.parameters())


# ----------------------------------------------------------------------------- gradient
def test_gradient_flows_through_the_last_L_and_H_updates_only():
    model = tiny().train()
    recorder = BlockRecorder(model.block)
    model(*batch()).loss.backward()
    # the segment, then the no-grad segment that bootstraps the Q target
    assert [call["grad"] for call in recorder.calls] == [False] * 4 + [True, True] + [False] * 6
    recorder.remove()

    full = tiny(full_backprop=True).eval()
    recorder = BlockRecorder(full.block)
    full(*batch()).loss.backward()
    assert [call["grad"] for call in recorder.calls] == [True] * 6


def test_one_step_gradient_equals_a_hand_written_truncated_recurrence():
    model = tiny(halt_max_steps=1)  # no ACT target: the loss is lm + 0.5 q_halt
    ids, labels = batch()
    model(ids, labels=labels).loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    x = model.encode_input(ids, torch.zeros(3, dtype=torch.long))
    z_H, z_L = model.initial_states(3)

    def f(hidden, level):
        cos, sin = model.rotary(hidden.shape[1], hidden.dtype)
        return model.block(hidden, cos, sin, level=level)[0]

    with torch.no_grad():
        for _ in range(2):
            z_L = f(z_L + z_H + x, "L")
        z_H = f(z_H + z_L, "H")
        z_L = f(z_L + z_H + x, "L")
    z_L = f(z_L + z_H + x, "L")
    z_H = f(z_H + z_L, "H")
    logits = model.lm_head(z_H[:, 1:])
    lm = (stablemax_cross_entropy(logits, labels).sum(-1) / SEQ).mean()
    q_halt = model.q_head(z_H[:, 0])[:, 0]
    correct = (logits.argmax(-1) == labels).all(-1).double()
    (lm + 0.5 * F.binary_cross_entropy_with_logits(q_halt, correct)).backward()
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)


def test_the_carry_is_detached_and_no_gradient_reaches_an_earlier_segment():
    model = tiny()
    ids, labels = batch()
    first = model(ids, labels=labels)
    assert first.carry.z_H.grad_fn is None and first.carry.z_L.grad_fn is None
    carry = first.carry
    carry.z_H.requires_grad_(True)
    carry.halted = torch.zeros_like(carry.halted)
    model(ids, labels=labels, carry=carry).loss.backward()
    # the carried z_H enters only the no-grad sub-steps, so it gets no gradient
    assert carry.z_H.grad is None


# ----------------------------------------------------------------------------- injections
def _operator(model, name, x):
    if name == "linear":
        return model.input_proj(x)
    if name == "nonlinear":
        return torch.tanh(model.input_proj(x))
    if name == "sign_flip":
        return -x
    return x


def _expected_inputs(model, recorder, x, operator="add"):
    """Replay the recorded outputs: every block input must be z_self + u(z_other, x)."""
    n_L, n_H = model.config.injection_counts
    z_H, z_L = model.initial_states(x.shape[0])
    for call in recorder.calls:
        level = call["level"]
        z_self, z_other, n = (z_L, z_H, n_L) if level == "L" else (z_H, z_L, n_H)
        if n == 0:
            expected = z_self + z_other
        elif operator == "hadamard":
            expected = z_self + (z_other + z_self) * (n * x)
        else:
            expected = z_self + (z_other + n * _operator(model, operator, x))  # authors' order
        yield call, expected
        if level == "L":
            z_L = call["output"]
        else:
            z_H = call["output"]


@pytest.mark.parametrize("overrides", [
    *({"injection": name} for name in INJECTION_VARIANTS),
    *({"input_operator": name} for name in ("linear", "nonlinear", "sign_flip", "hadamard")),
], ids=lambda overrides: next(iter(overrides.values())))
def test_each_variant_feeds_f_exactly_z_self_plus_z_other_plus_n_g_of_x(overrides):
    model = tiny(**overrides).eval()
    ids, _ = batch()
    recorder = BlockRecorder(model.block)
    with torch.no_grad():
        model(ids)
        x = model.encode_input(ids, torch.zeros(3, dtype=torch.long))
        for call, expected in _expected_inputs(model, recorder, x, model.config.input_operator):
            assert torch.equal(call["input"], expected), (overrides, call["level"])


def test_single_state_ablation_injects_periodically_into_one_state():
    model = tiny(single_state=True).eval()
    ids, _ = batch()
    recorder = BlockRecorder(model.block)
    with torch.no_grad():
        output = model(ids, return_intermediate=True)
        x = model.encode_input(ids, torch.zeros(3, dtype=torch.long))
    z = model.initial_states(3)[0]
    for call in recorder.calls:
        expected = z + x if call["level"] == "L" else z
        assert torch.equal(call["input"], expected)
        z = call["output"]
    assert output.carry.z_L is None and output.z_L_logits is None


def test_input_encoding_is_scaled_embeddings_after_the_puzzle_prefix():
    model = tiny(puzzle_emb_len=2, num_puzzle_identifiers=3)
    with torch.no_grad():
        model.puzzle_emb.weight.normal_()
    ids, _ = batch()
    pid = torch.tensor([0, 2, 1])
    x = model.encode_input(ids, pid)
    scale = math.sqrt(16)
    assert x.shape == (3, 2 + SEQ, 16)
    assert torch.equal(x[:, 2:], model.embed_tokens(ids) * scale)
    assert torch.equal(x[:, :2], model.puzzle_emb(pid).view(3, 2, 16) * scale)


# ----------------------------------------------------------------------------- level tokens
def test_addition_level_token_is_added_to_every_position():
    model = tiny(injection="L2x_H2x", level_token="addition").eval()
    ids, _ = batch()
    recorder = BlockRecorder(model.block)
    with torch.no_grad():
        model(ids)
        x = model.encode_input(ids, torch.zeros(3, dtype=torch.long))
        for call, expected in _expected_inputs(model, recorder, x):
            level = model.level_emb[0 if call["level"] == "L" else 1]
            assert torch.equal(call["input"], expected + level)


def test_prepend_strip_puts_the_level_token_at_position_0_and_strips_it():
    model = tiny(injection="L2x_H2x", level_token="prepend_strip").eval()
    ids, _ = batch()
    recorder = BlockRecorder(model.block)
    with torch.no_grad():
        output = model(ids)
        x = model.encode_input(ids, torch.zeros(3, dtype=torch.long))
        assert model.state_len == 1 + SEQ and output.carry.z_H.shape[1] == 1 + SEQ
        z_H, z_L = model.initial_states(3)
        for call in recorder.calls:
            level = call["level"]
            token = model.level_emb[0 if level == "L" else 1]
            assert call["input"].shape[1] == 2 + SEQ
            assert torch.equal(call["input"][:, 0], token.expand(3, -1))
            z_self, z_other = (z_L, z_H) if level == "L" else (z_H, z_L)
            assert torch.equal(call["input"][:, 1:], z_self + (z_other + 2 * x))
            if level == "L":
                z_L = call["output"][:, 1:]
            else:
                z_H = call["output"][:, 1:]
        assert torch.equal(output.carry.z_H, z_H)


def test_prepend_no_strip_keeps_the_level_token_inside_each_state():
    model = tiny(injection="L2x_H2x", level_token="prepend_no_strip").eval()
    ids, _ = batch()
    z_H, z_L = model.initial_states(3)
    assert model.state_len == 2 + SEQ and model.state_offset == 2
    assert torch.equal(z_L[:, 0], model.level_emb[0].expand(3, -1).detach())
    assert torch.equal(z_H[:, 0], model.level_emb[1].expand(3, -1).detach())
    x = model.encode_input(ids, torch.zeros(3, dtype=torch.long))
    assert torch.equal(x[:, 0], torch.zeros(3, 16, dtype=x.dtype))  # no input at the token
    recorder = BlockRecorder(model.block)
    with torch.no_grad():
        output = model(ids)
        for call, expected in _expected_inputs(model, recorder, x):
            assert call["input"].shape[1] == 2 + SEQ
            assert torch.equal(call["input"], expected)
            assert call["output"].shape[1] == 2 + SEQ
    assert torch.equal(output.logits, model.lm_head(output.carry.z_H[:, 2:]))


# ----------------------------------------------------------------------------- ACT
def _prefer(model, halt: bool) -> None:
    with torch.no_grad():
        model.q_head.bias.copy_(torch.tensor([10.0, -10.0] if halt else [-10.0, 10.0]))


def test_act_halts_only_at_the_limit_in_eval_even_when_the_q_head_says_halt():
    model = tiny(halt_max_steps=3).eval()
    _prefer(model, halt=True)
    ids, labels = batch()
    carry = None
    halted = []
    with torch.no_grad():
        for _ in range(3):
            output = model(ids, labels=labels, carry=carry)
            carry = output.carry
            halted.append(carry.halted.tolist())
            assert output.target_q_continue is None
    assert halted == [[False] * 3, [False] * 3, [True] * 3]


def test_act_in_training_halts_on_the_q_head_unless_exploration_holds_the_row():
    ids, labels = batch(rows=64)
    greedy = tiny(halt_max_steps=6, halt_exploration_prob=0.0).train()
    _prefer(greedy, halt=True)
    assert greedy(ids, labels=labels).carry.halted.all()

    explore = tiny(halt_max_steps=6, halt_exploration_prob=1.0).train()
    _prefer(explore, halt=True)
    carry = explore(ids, labels=labels).carry
    assert not carry.halted.any()  # every row drew a minimum of at least 2 segments

    partial = tiny(halt_max_steps=16, halt_exploration_prob=0.5).train()
    _prefer(partial, halt=True)
    halted = partial(ids, labels=labels).carry.halted
    assert 0 < halted.sum() < 64  # roughly half the rows explore


def test_act_in_training_continues_when_the_q_head_prefers_it_until_the_limit():
    model = tiny(halt_max_steps=3, halt_exploration_prob=0.0).train()
    _prefer(model, halt=False)
    ids, labels = batch()
    carry = None
    for step in range(1, 4):
        output = model(ids, labels=labels, carry=carry)
        carry = output.carry
        assert carry.halted.all() == (step == 3)


def test_bootstrapped_q_target_is_the_next_segments_best_q():
    model = tiny(halt_max_steps=3, halt_exploration_prob=0.0).train()
    ids, labels = batch()
    output = model(ids, labels=labels)
    with torch.no_grad():
        x = model.encode_input(ids, torch.zeros(3, dtype=torch.long))
        next_H, _, _ = model.run_segment(output.carry.z_H, output.carry.z_L, x)
        halt, cont = model.q_logits(next_H)
    torch.testing.assert_close(output.target_q_continue, torch.sigmoid(torch.maximum(halt, cont)),
                               rtol=0, atol=0)
    assert output.q_continue_loss is not None
    torch.testing.assert_close(
        output.loss, output.lm_loss + 0.5 * (output.q_halt_loss + output.q_continue_loss))


def test_only_halted_rows_restart_on_the_new_batch():
    model = tiny().eval()
    old_ids, old_labels = batch(rows=4, seed=1)
    new_ids, new_labels = batch(rows=4, seed=2)
    with torch.no_grad():
        first = model(old_ids, labels=old_labels)
        carry = first.carry
        carry.halted = torch.tensor([True, False, True, False])
        mixed = model(new_ids, labels=new_labels, carry=carry)
        fresh = model(new_ids, labels=new_labels)
        carry.halted = torch.zeros(4, dtype=torch.bool)
        carried = model(old_ids, labels=old_labels, carry=carry)
    rows_new, rows_old = [0, 2], [1, 3]
    assert torch.equal(mixed.carry.input_ids[rows_new], new_ids[rows_new])
    assert torch.equal(mixed.carry.input_ids[rows_old], old_ids[rows_old])
    assert torch.equal(mixed.carry.labels[rows_old], old_labels[rows_old])
    assert mixed.carry.steps.tolist() == [1, 2, 1, 2]
    torch.testing.assert_close(mixed.logits[rows_new], fresh.logits[rows_new], rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(mixed.logits[rows_old], carried.logits[rows_old], rtol=1e-12,
                               atol=1e-12)


def test_labels_never_pair_with_another_rows_puzzle():
    model = tiny().eval()
    ids, labels = batch()
    with torch.no_grad():
        unlabelled = model(ids)
        assert model(ids, carry=unlabelled.carry).carry.labels is None
        with pytest.raises(ValueError, match="without labels"):
            model(ids, labels=labels, carry=unlabelled.carry)
        labelled = model(ids, labels=labels)
        assert model(ids, carry=labelled.carry).loss is None  # no labels given: no loss


# ----------------------------------------------------------------------------- losses
def test_stablemax_matches_its_closed_form():
    logits = torch.tensor([[-2.0, 0.0, 3.0]], dtype=torch.float64)
    s = torch.tensor([1 / 3, 1.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(log_stablemax(logits)[0], torch.log(s / s.sum()), rtol=0,
                               atol=1e-15)
    loss = stablemax_cross_entropy(logits, torch.tensor([2]))
    torch.testing.assert_close(loss, -torch.log(s[2:] / s.sum()))
    assert stablemax_cross_entropy(logits, torch.tensor([-100])).item() == 0.0


def test_stablemax_stays_finite_where_softmax_underflows():
    logits = torch.tensor([[1e30, -1e30, 0.0, 2e4]], dtype=torch.float32, requires_grad=True)
    loss = stablemax_cross_entropy(logits, torch.tensor([1]))
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # the target's probability is tiny but positive; softmax rounds it to exactly zero
    assert torch.exp(log_stablemax(logits.detach().double()))[0, 1] > 0
    assert F.softmax(logits.detach().double(), -1)[0, 1] == 0


def test_stablemax_gradient_is_finite_at_a_logit_of_exactly_one():
    # regression: a logit of exactly 1.0 once made a training run's gradient NaN
    logits = torch.tensor([[1.0, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    stablemax_cross_entropy(logits, torch.tensor([2])).sum().backward()
    s = torch.tensor([2.0, 1 / 1.5, 1.0], dtype=torch.float64)
    ds = torch.tensor([1.0, 1 / 1.5**2, 1.0], dtype=torch.float64)  # s'(x) on each branch
    expected = ds / s.sum() - torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64) * ds / s
    torch.testing.assert_close(logits.grad[0], expected, rtol=1e-12, atol=1e-15)


def test_softmax_loss_option_is_plain_cross_entropy():
    model = tiny(loss_type="softmax", halt_max_steps=1).eval()
    ids, labels = batch()
    output = model(ids, labels=labels)
    want = F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(output.lm_loss, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- analysis hooks
def test_freeze_state_keeps_that_state_constant():
    ids, _ = batch()
    for frozen, other in (("H", "L"), ("L", "H")):
        model = tiny().eval()
        recorder = BlockRecorder(model.block)
        with torch.no_grad():
            output = model(ids, freeze_state=frozen, return_intermediate=True)
            start = model.initial_states(3)[0 if frozen == "H" else 1]
        assert set(recorder.levels) == {other}
        decoded = output.z_H_logits if frozen == "H" else output.z_L_logits
        for step in decoded:
            assert torch.equal(step, model.decode(start))
        state = output.carry.z_H if frozen == "H" else output.carry.z_L
        assert torch.equal(state, start)


def test_intermediate_decodings_and_attention_maps_cover_every_sub_step():
    model = tiny().eval()
    ids, _ = batch()
    with torch.no_grad():
        plain = model(ids)
        output = model(ids, return_intermediate=True, output_attentions=True)
    assert output.z_H_logits.shape == (6, 3, SEQ, VOCAB) == output.z_L_logits.shape
    torch.testing.assert_close(output.z_H_logits[-1], output.logits, rtol=0, atol=0)
    assert len(output.attentions) == 6 and all(len(maps) == 2 for maps in output.attentions)
    for maps in output.attentions:
        for weights in maps:
            assert weights.shape == (3, 2, 1 + SEQ, 1 + SEQ)
            torch.testing.assert_close(weights.sum(-1), torch.ones(3, 2, 1 + SEQ,
                                                                   dtype=torch.float64))
    # the explicit-softmax path (used for attention maps) equals the SDPA path
    torch.testing.assert_close(output.logits, plain.logits, rtol=1e-12, atol=1e-12)


def test_solve_runs_segments_like_repeated_forward_calls():
    model = tiny(halt_max_steps=3).eval()
    ids, _ = batch()
    solution = model.solve(ids, return_trace=True)
    carry = None
    with torch.no_grad():
        for _ in range(3):
            output = model(ids, carry=carry)
            carry = output.carry
    assert solution.segments.tolist() == [3, 3, 3] and len(solution.trace) == 3
    torch.testing.assert_close(solution.logits, output.logits, rtol=0, atol=0)
    assert torch.equal(solution.predictions, output.logits.argmax(-1))


def test_solve_with_q_halting_freezes_each_row_at_its_first_halt():
    model = tiny(halt_max_steps=5).eval()
    _prefer(model, halt=True)
    ids, _ = batch()
    solution = model.solve(ids, halting="q", return_trace=True)
    assert solution.segments.tolist() == [1, 1, 1] and len(solution.trace) == 1
    with pytest.raises(ValueError, match="halting"):
        model.solve(ids, halting="never")
    with pytest.raises(ValueError, match="max_segments"):
        model.solve(ids, max_segments=0)


# ----------------------------------------------------------------------------- persistence
def test_save_and_load_round_trip_through_the_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModel

    model = tiny(level_token="prepend_strip", injection="L2x_H2x").float().eval()
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, AIRConfig) and config.level_token == "prepend_strip"
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, AIRSolver)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    ids, _ = batch()
    assert torch.equal(model.solve(ids).logits, loaded.solve(ids).logits)


@pytest.mark.slow
def test_loads_with_trust_remote_code_offline_in_a_fresh_process(tmp_path):
    model = tiny().float().eval()
    ids, _ = batch()
    assert assert_remote_code_load_is_exact(model, ids, tmp_path) == "AIRSolver"


# ----------------------------------------------------------------------------- authors' defaults
def test_swiglu_width_rounds_up_to_a_multiple_of_256_as_the_authors():
    assert AIRConfig().intermediate_size == 1536  # 2/3 * 4 * 512 = 1365.3 -> 1536
    assert AIRConfig(hidden_size=128, num_attention_heads=4).intermediate_size == 512
    assert AIRConfig(hidden_size=16, num_attention_heads=2).intermediate_size == 256
    assert AIRConfig(intermediate_size=100).intermediate_size == 100


def test_initialisers_draw_the_target_std_inside_two_of_their_scale():
    torch.manual_seed(0)
    values = variance_corrected_trunc_normal_(torch.empty(1_000_000, dtype=torch.float64), 0.5)
    assert abs(values.std().item() - 0.5) < 0.002  # plain trunc_normal_ would give 0.44
    density = math.exp(-2) / math.sqrt(2 * math.pi)  # phi(2)
    truncated_variance = 1 - 4 * density / math.erf(math.sqrt(2))  # N(0, 1) cut at +-2: 0.7737
    scale = 0.5 / math.sqrt(truncated_variance)
    assert values.abs().max().item() <= 2 * scale + 1e-12
    assert values.abs().max().item() > 2 * scale * 0.99
    assert torch.equal(variance_corrected_trunc_normal_(torch.ones(3), 0.0), torch.zeros(3))


def test_model_starts_from_the_authors_initialisation():
    torch.manual_seed(0)
    model = AIRSolver(AIRConfig(vocab_size=VOCAB, seq_len=SEQ, hidden_size=256,
                                num_hidden_layers=1, num_attention_heads=4,
                                level_token="addition"))
    weight = model.block.layers[0].mlp.down_proj.weight  # in_features = 768
    assert abs(weight.std().item() - 1 / math.sqrt(768)) < 0.01 / math.sqrt(768)
    assert abs(model.H_init.std().item() - 1.0) < 0.15  # 256 draws of std 1
    assert torch.equal(model.level_emb, torch.zeros_like(model.level_emb))
    assert torch.equal(model.q_head.weight, torch.zeros_like(model.q_head.weight))
