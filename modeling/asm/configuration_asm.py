"""Configuration of ASMForCausalLM (Addressed State Memory: stacked Addressed State Attention)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

__all__ = ["ASMConfig"]

WRITE_KEY_POSITIONS = ("none", "rotary")
SCAN_BACKENDS = ("auto", "torch", "triton", "triton_chunk")
CONTENT_GAINS = ("sigmoid", "softplus_clamp")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ASMConfig.{name} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any, *, positive: bool = False, low: float | None = None,
                 high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and positive:
        ok = value > 0
    if ok and low is not None:
        ok = value >= low
    if ok and high is not None:
        ok = value < high
    if not ok:
        bounds = " > 0" if positive else ""
        if low is not None or high is not None:
            bounds = f" in [{low}, {high})"
        raise ValueError(f"ASMConfig.{name} must be a number{bounds}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"ASMConfig.{name} must be a bool, got {value!r}")


class ASMConfig(PretrainedConfig):
    """Sizes and switches of an ASM language model (defaults: the paper's ASM-57M).

    Fidelity options: the defaults follow the paper's formulas as written. The paper's ASM-57M
    was trained with the authors' public code, which differs in two places; its numbers (and
    its weights, converted) need ``content_gain="softplus_clamp"`` and ``slot_space_rope=True``.
    See the "Fidelity options" section of README.md.

    Args:
        vocab_size: token vocabulary (GPT-2's 50257).
        hidden_size: ``d_model`` (384); a multiple of ``num_attention_heads``.
        num_hidden_layers: ASA blocks (21).
        num_attention_heads: heads per block (8); head width ``hidden_size / heads``.
        num_slots: ``K`` slots per head (16).
        slot_space_dim: ``M``, width of the slot-space refinement (32).
        mlp_ratio: MLP width as a multiple of ``hidden_size`` (4.0).
        dropout: residual, embedding and slot-space dropout probability.
        slot_dropout: probability of hiding a slot from the read of one (row, head) in training.
        tie_word_embeddings: share the input embedding and the output projection.
        write_temperature: divides the write logits ``<k_s, k_t> / sqrt(d)``.
        read_temperature: divides the read logits.
        use_recency_bias: ALiBi-style write bias ``lambda * a_h * position`` (recency).
        recency_strength_init: initial ``lambda = softplus(raw)``.
        learn_recency_strength: ``lambda`` is a parameter (else fixed at its initial value).
        write_key_position: positional map on write keys: ``"none"`` or ``"rotary"`` (a true
            rotation, half-split layout).
        rope_theta: base of the rotary frequencies.
        use_content_read: add ``gamma * <q_t, slot_s(t)> / sqrt(d)`` to the read logits.
        content_read_init: initial raw ``gamma`` (see ``content_gain``).
        content_read_max_gamma: bound of ``gamma``.
        content_gain: how ``gamma`` follows from its raw parameter: ``"sigmoid"`` (the paper's
            formula, ``gamma = max_gamma * sigmoid(raw)``, in ``(0, max_gamma)``) or
            ``"softplus_clamp"`` (the authors' public code, ``gamma = min(softplus(raw),
            max_gamma)``: no gradient to ``raw`` once clamped; the same ``content_read_init``
            gives a different initial ``gamma``). A fidelity option, see README.md.
        use_slot_space_refinement: the second-order refinement ``Delta`` on/off.
        refinement_gate_init: initial raw gate; ``g = softplus(raw)``.
        slot_space_rope: rotate the slot-space queries and keys ``W_q u_t``, ``W_k u_t`` (not
            the values) by each token's position before ``phi = elu + 1``, as the authors'
            public code does (the paper does not mention it). A true rotation, half-split
            layout, at the same position ids as the write keys (real tokens counted from 0 in
            each row). The authors' ``_rotate_half`` pairs interleaved coordinates with
            half-split frequencies, which is not a rotation, and counts positions including
            padding; we read its intent as a true rotary map (a documented guess). Needs an
            even ``slot_space_dim``. A fidelity option, see README.md.
        slot_space_rope_theta: base of the slot-space rotary frequencies (the authors' 100000).
        chunk_size: positions per chunk of the chunk-parallel scan (any value gives the same
            result up to rounding; 32, the fastest CPU training step of 16 / 32 / 64 measured,
            see BENCHMARKS.md).
        scan_backend: ``"auto"`` (on CUDA the chunk-parallel Triton kernels for passes of 32
            positions or more and the recurrent ones below; else the chunk-parallel PyTorch
            form), ``"torch"``, ``"triton"`` (the recurrent kernels) or ``"triton_chunk"``
            (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``asm_ops.py`` is the one dispatcher.
        layer_norm_eps: LayerNorm epsilon.
        initializer_range: std of the normal initialisation of linear and embedding weights.
        max_position_embeddings: training context (informational: there is no position table).
        use_cache: return an :class:`ASMCache` by default.
    """

    model_type = "asm"

    def __init__(
        self,
        vocab_size: int = 50257,
        hidden_size: int = 384,
        num_hidden_layers: int = 21,
        num_attention_heads: int = 8,
        num_slots: int = 16,
        slot_space_dim: int = 32,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        slot_dropout: float = 0.0,
        tie_word_embeddings: bool = True,
        write_temperature: float = 1.0,
        read_temperature: float = 1.0,
        use_recency_bias: bool = True,
        recency_strength_init: float = 0.1,
        learn_recency_strength: bool = True,
        write_key_position: str = "rotary",
        rope_theta: float = 10000.0,
        use_content_read: bool = True,
        content_read_init: float = -4.0,
        content_read_max_gamma: float = 3.0,
        content_gain: str = "sigmoid",
        use_slot_space_refinement: bool = True,
        refinement_gate_init: float = -4.0,
        slot_space_rope: bool = False,
        slot_space_rope_theta: float = 100000.0,
        chunk_size: int = 32,
        scan_backend: str = "auto",
        layer_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 1024,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                            ("num_hidden_layers", num_hidden_layers),
                            ("num_attention_heads", num_attention_heads),
                            ("num_slots", num_slots), ("slot_space_dim", slot_space_dim),
                            ("chunk_size", chunk_size),
                            ("max_position_embeddings", max_position_embeddings)):
            _check_int(name, value, 1)
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"ASMConfig.hidden_size ({hidden_size}) must be a multiple of "
                f"num_attention_heads ({num_attention_heads})"
            )
        head_dim = hidden_size // num_attention_heads
        if write_key_position not in WRITE_KEY_POSITIONS:
            raise ValueError(f"ASMConfig.write_key_position must be one of {WRITE_KEY_POSITIONS}, "
                             f"got {write_key_position!r}")
        if write_key_position == "rotary" and head_dim % 2:
            raise ValueError(f"ASMConfig.write_key_position 'rotary' needs an even head width, "
                             f"got {head_dim}")
        if scan_backend not in SCAN_BACKENDS:
            raise ValueError(f"ASMConfig.scan_backend must be one of {SCAN_BACKENDS}, "
                             f"got {scan_backend!r}")
        if content_gain not in CONTENT_GAINS:
            raise ValueError(f"ASMConfig.content_gain must be one of {CONTENT_GAINS}, "
                             f"got {content_gain!r}")
        for name, value in (("mlp_ratio", mlp_ratio), ("write_temperature", write_temperature),
                            ("read_temperature", read_temperature), ("rope_theta", rope_theta),
                            ("recency_strength_init", recency_strength_init),
                            ("content_read_max_gamma", content_read_max_gamma),
                            ("slot_space_rope_theta", slot_space_rope_theta),
                            ("layer_norm_eps", layer_norm_eps),
                            ("initializer_range", initializer_range)):
            _check_float(name, value, positive=True)
        for name, value in (("dropout", dropout), ("slot_dropout", slot_dropout)):
            _check_float(name, value, low=0.0, high=1.0)
        for name, value in (("content_read_init", content_read_init),
                            ("refinement_gate_init", refinement_gate_init)):
            _check_float(name, value)
        for name, value in (("tie_word_embeddings", tie_word_embeddings),
                            ("use_recency_bias", use_recency_bias),
                            ("learn_recency_strength", learn_recency_strength),
                            ("use_content_read", use_content_read),
                            ("use_slot_space_refinement", use_slot_space_refinement),
                            ("slot_space_rope", slot_space_rope),
                            ("use_cache", use_cache)):
            _check_bool(name, value)
        if slot_space_rope and slot_space_dim % 2:
            raise ValueError(f"ASMConfig.slot_space_rope needs an even slot_space_dim, "
                             f"got {slot_space_dim}")
        if int(hidden_size * mlp_ratio) < 1:
            raise ValueError(f"ASMConfig.mlp_ratio gives an empty MLP, got {mlp_ratio!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_slots = num_slots
        self.slot_space_dim = slot_space_dim
        self.mlp_ratio = float(mlp_ratio)
        self.dropout = float(dropout)
        self.slot_dropout = float(slot_dropout)
        self.write_temperature = float(write_temperature)
        self.read_temperature = float(read_temperature)
        self.use_recency_bias = use_recency_bias
        self.recency_strength_init = float(recency_strength_init)
        self.learn_recency_strength = learn_recency_strength
        self.write_key_position = write_key_position
        self.rope_theta = float(rope_theta)
        self.use_content_read = use_content_read
        self.content_read_init = float(content_read_init)
        self.content_read_max_gamma = float(content_read_max_gamma)
        self.content_gain = content_gain
        self.use_slot_space_refinement = use_slot_space_refinement
        self.refinement_gate_init = float(refinement_gate_init)
        self.slot_space_rope = slot_space_rope
        self.slot_space_rope_theta = float(slot_space_rope_theta)
        self.chunk_size = chunk_size
        self.scan_backend = scan_backend
        self.layer_norm_eps = float(layer_norm_eps)
        self.initializer_range = float(initializer_range)
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        if vocab_size > 50256:  # GPT-2's <|endoftext|>, the paper's tokenizer
            kwargs.setdefault("bos_token_id", 50256)
            kwargs.setdefault("eos_token_id", 50256)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
