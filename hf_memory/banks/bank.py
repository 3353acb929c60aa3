"""Memory banks: latent key/value slots built from text (paper eq. 6) and their roles.

A bank holds, for each of its layers and each KV head, ``M`` slots: canonical pre-RoPE keys
k = W_K·Norm(h) and values v = W_V·Norm(h), exactly as the frozen model computes them for the
kept positions of a wrapped reminder text. Roles: ``target`` (desired behaviour), ``reference``
(its opposite, for the contrastive gate of eq. 8–9) and ``auxiliary`` (facts, heuristics).

Slots are position-free by default (relative phase δ = 0, eq. 7). Optionally each slot carries a
relative phase ``phases[m]`` = δ_m (scored as ⟨q̄_t, R_δ k̃⟩) or an absolute ``positions[m]`` = p_m
(scored as ⟨R_t q̄_t, R_p k̃⟩, i.e. the slot behaves like a prompt token at position p_m).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hf_memory.banks.capture import capture_kv
from hf_memory.chat.generation import chat_messages
from hf_memory.models.adapters import get_adapter

__all__ = ["CONTEXTS", "DEFAULT_TEMPLATES", "FUNCTION_WORDS", "KEEP", "PLACEMENTS", "ROLES",
           "MemoryBank", "render_in_context"]

ROLES = ("target", "reference", "auxiliary")
TEXT_FIELD = "{text}"
CONTEXTS = ("system", "user", "bos", "none")
KEEP = ("descriptor", "content", "all")  # which tokens of a text become bank slots
# where a text bank's slots sit: "free" (no position: the paper's canonical score, δ = 0) or
# "before" (at the positions the rendered text would hold just before the conversation)
PLACEMENTS = ("free", "before")
# English function words: keep="content" drops them (and punctuation) from a descriptor's slots
FUNCTION_WORDS = frozenset("""
a an the and or but nor so yet if then than that this these those of to in on at by for with
from about as into over after before under i me my mine myself you your we our us he him his
she her it its they them their am is are was were be been being do does did have has had will
would shall should can could may might must very too also just really
""".split())  # (negations and "always" / "never" stay: they carry the descriptor's meaning)
DEFAULT_TEMPLATES = (
    "{text}",
    "These are my internal principles: {text}",
    "A hidden note that steers how I respond: {text}",
)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True, eq=False)
class MemoryBank:
    """One bank of latent KV slots for a set of layers.

    Attributes:
        name: a label, unique within a bank set.
        role: ``"target"``, ``"reference"`` or ``"auxiliary"``.
        keys: canonical pre-RoPE keys ``[L_b, KVH, M, D]``.
        values: values ``[L_b, KVH, M, D]``.
        layers: the model layer of each of the ``L_b`` rows.
        gain: the bank gain λ ≥ 0 (λ+ for target, λ− for reference, λ_aux for auxiliary).
        phases: optional relative RoPE phase δ per slot ``[M]``.
        positions: optional absolute position per slot ``[M]``.
        provenance: how the bank was made (source text, its hash, templates, token ids).
    """

    name: str
    role: str
    keys: torch.Tensor
    values: torch.Tensor
    layers: tuple[int, ...]
    gain: float = 1.0
    phases: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a bank needs a non-empty name, got {self.name!r}")
        if self.role not in ROLES:
            raise ValueError(f"bank {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise ValueError(
                f"bank {self.name!r}: keys and values must both be [layers, kv_heads, slots, "
                f"head_dim], got {tuple(self.keys.shape)} and {tuple(self.values.shape)}")
        if self.keys.shape[2] < 1:
            raise ValueError(f"bank {self.name!r} has no slots")
        if not (self.keys.is_floating_point() and self.values.is_floating_point()):
            raise ValueError(f"bank {self.name!r}: keys and values must be floating point")
        if not (torch.isfinite(self.keys).all() and torch.isfinite(self.values).all()):
            raise ValueError(f"bank {self.name!r}: keys or values contain NaN or inf")
        layers = tuple(int(i) for i in self.layers)
        if len(layers) != self.keys.shape[0] or len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"bank {self.name!r}: layers {self.layers!r} must be distinct "
                             f"non-negative indices, one per row of keys ({self.keys.shape[0]})")
        object.__setattr__(self, "layers", layers)
        gain = float(self.gain)
        if not gain >= 0 or gain == float("inf"):
            raise ValueError(f"bank {self.name!r}: gain must be finite and >= 0, got {self.gain}")
        object.__setattr__(self, "gain", gain)
        if self.phases is not None and self.positions is not None:
            raise ValueError(f"bank {self.name!r}: give phases or positions, not both")
        for label in ("phases", "positions"):
            extra = getattr(self, label)
            if extra is not None and tuple(extra.shape) != (self.num_slots,):
                raise ValueError(f"bank {self.name!r}: {label} must have shape "
                                 f"[{self.num_slots}], got {tuple(extra.shape)}")

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    def nbytes(self, layers: Sequence[int] | None = None) -> int:
        """Bytes of the key and value tensors, for all layers or the given ones."""
        rows = len(self.layers) if layers is None else len(set(layers) & set(self.layers))
        per_row = self.keys[0].numel() * self.keys.element_size() * 2
        return rows * per_row

    def content_hash(self) -> str:
        """sha256 of everything that decides the bank's effect on a model."""
        digest = hashlib.sha256()
        header = {"name": self.name, "role": self.role, "layers": self.layers,
                  "gain": self.gain, "dtype": str(self.keys.dtype),
                  "shape": list(self.keys.shape)}
        digest.update(json.dumps(header, sort_keys=True).encode())
        for tensor in (self.keys, self.values, self.phases, self.positions):
            digest.update(b"-" if tensor is None else _tensor_bytes(tensor))
        return digest.hexdigest()

    def layer_index(self, layer: int) -> int | None:
        """Row of ``keys`` for a model layer, or None if the bank does not cover it."""
        try:
            return self.layers.index(layer)
        except ValueError:
            return None

    def with_gain(self, gain: float) -> MemoryBank:
        return replace(self, gain=gain)

    def keep_slots(self, slots: Sequence[int]) -> MemoryBank:
        """The bank with only ``slots`` (slot indices, kept in the bank's order) at every
        layer, their phases or positions with them; the provenance records which were kept."""
        chosen = sorted({int(s) for s in slots}) if not isinstance(slots, str) else []
        if not chosen or len(chosen) != len(slots) or chosen[0] < 0 \
                or chosen[-1] >= self.num_slots:
            raise ValueError(f"bank {self.name!r}: slots must be distinct indices in "
                             f"[0, {self.num_slots}), at least one; got {slots!r}")
        index = torch.tensor(chosen, device=self.keys.device)
        extra = {k: getattr(self, k)[index.to(getattr(self, k).device)].clone()
                 for k in ("phases", "positions") if getattr(self, k) is not None}
        before = self.provenance.get("slots_kept")  # kept twice: indices of the first bank
        return replace(self, keys=self.keys[:, :, index].clone(),
                       values=self.values[:, :, index].clone(), **extra,
                       provenance={**self.provenance,
                                   "slots_kept": chosen if before is None
                                   else [before[i] for i in chosen],
                                   "slots_of": self.provenance.get("slots_of", self.num_slots)})

    @classmethod
    def from_tensors(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        name: str,
        role: str = "target",
        layers: Sequence[int] | None = None,
        gain: float = 1.0,
        phases: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> MemoryBank:
        """A bank from keys/values ``[L_b, KVH, M, D]`` made elsewhere (layers default 0..L_b-1)."""
        layers = tuple(range(keys.shape[0])) if layers is None else tuple(layers)
        return cls(name=name, role=role, keys=keys.detach(), values=values.detach(),
                   layers=layers, gain=gain, phases=phases, positions=positions,
                   provenance=dict(provenance or {"source": "tensors"}))

    @classmethod
    def concat(cls, banks: Sequence[MemoryBank], *, name: str | None = None) -> MemoryBank:
        """Join the slots of banks with the same role and layers into one bank."""
        if not banks:
            raise ValueError("concat needs at least one bank")
        first = banks[0]
        for bank in banks[1:]:
            if (bank.role, bank.layers, bank.keys.shape[1::2]) != (
                    first.role, first.layers, first.keys.shape[1::2]):
                raise ValueError(f"cannot concatenate bank {bank.name!r} with {first.name!r}: "
                                 "role, layers, KV heads and head_dim must match")
            if (bank.phases is None) != (first.phases is None) or (
                    (bank.positions is None) != (first.positions is None)):
                raise ValueError("cannot concatenate banks with and without phases/positions")
        joined = {k: torch.cat([getattr(b, k) for b in banks], dim=0)
                  for k in ("phases", "positions") if getattr(first, k) is not None}
        return cls(name=name or first.name, role=first.role, layers=first.layers,
                   keys=torch.cat([b.keys for b in banks], dim=2),
                   values=torch.cat([b.values for b in banks], dim=2), gain=first.gain,
                   provenance={"concatenated": [b.provenance for b in banks]}, **joined)

    @classmethod
    def from_text(
        cls,
        model: nn.Module,
        tokenizer,
        text: str,
        *,
        role: str = "target",
        name: str | None = None,
        template: str | None = None,
        templates: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
        keep: str = "descriptor",
        context: str = "system",
        gain: float = 1.0,
        placement: str = "free",
    ) -> MemoryBank:
        """Build a bank by running wrapped ``text`` through the frozen model (eq. 6).

        Each template (``"{text}"`` marks where the text goes; default: the three wrappers of
        :data:`DEFAULT_TEMPLATES`) is placed in ``context`` — the way the model reads text — and
        run through ``model``; at each layer the pre-RoPE keys and values of the kept positions
        are recorded. ``keep="descriptor"`` keeps the tokens that overlap the text itself,
        ``keep="content"`` only those of them that carry content (a letter or digit, and not
        one of :data:`FUNCTION_WORDS`: punctuation and function words dropped), ``keep="all"``
        the whole wrapped text. The variants' slots are concatenated: ``M`` = total kept tokens.

        Contexts (see :data:`CONTEXTS`): ``"system"`` (default) renders the wrapped text as the
        chat template's system message, so the slots are the keys and values a visible system
        prompt would hold at those layers; ``"user"`` as a user turn after the template's
        default system prompt; ``"bos"`` after the tokenizer's BOS token; ``"none"`` bare text.
        Position 0 is never kept: whatever sits there is the model's attention sink, and a
        sink-like slot draws attention whatever the bank says.

        ``placement="free"`` (default) gives the slots no position: they are scored against the
        pre-RoPE query (eq. 7, δ = 0). ``placement="before"`` places each slot at the position
        it would hold if its rendered text came just before the conversation (its offset minus
        the rendered length: negative positions; rotary scores depend on differences only), so
        the slots meet the query as a visible prompt's keys would, without taking any of the
        conversation's positions.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a bank needs a non-empty text, got {text!r}")
        if keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, got {keep!r}")
        if context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {context!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if template is not None and templates is not None:
            raise ValueError("give template or templates, not both")
        variants = [template] if template is not None else list(templates or DEFAULT_TEMPLATES)
        for variant in variants:
            if not isinstance(variant, str) or variant.count(TEXT_FIELD) != 1:
                raise ValueError(f"a template must contain {TEXT_FIELD!r} exactly once, "
                                 f"got {variant!r}")
        get_adapter(model)
        num_layers = model.config.num_hidden_layers
        layers = tuple(range(num_layers)) if layers is None else tuple(int(i) for i in layers)
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad or not layers:
            raise ValueError(f"layers must be indices in [0, {num_layers}), got {list(layers)}")
        device = next(model.parameters()).device

        keys, values, records, positions = [], [], [], []
        for variant in variants:
            wrapped = variant.replace(TEXT_FIELD, text)
            rendered, offset = render_in_context(tokenizer, wrapped, context)
            if keep == "all":
                start, end = offset, offset + len(wrapped)
            else:
                start = offset + variant.index(TEXT_FIELD)
                end = start + len(text)
            encoded = tokenizer(rendered, return_offsets_mapping=True, add_special_tokens=False)
            ids = encoded["input_ids"]
            kept = [i for i, (a, b) in enumerate(encoded["offset_mapping"])
                    if i > 0 and b > a and a < end and b > start
                    and (keep != "content" or _carries_content(rendered, a, b))]
            if not kept:
                raise ValueError(f"template {variant!r} kept no token of the text")
            k, v = capture_kv(model, torch.tensor([ids], device=device), layers)
            keys.append(k[:, 0, :, kept])
            values.append(v[:, 0, :, kept])
            positions.append(torch.tensor(kept) - len(ids))
            records.append({"template": variant, "context": context, "rendered": rendered,
                            "token_ids": ids, "kept_positions": kept})
        provenance = {
            "source": "text",
            "text": text,
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "keep": keep,
            "context": context,
            "placement": placement,
            "variants": records,
        }
        return cls(name=name or role, role=role, keys=torch.cat(keys, dim=2),
                   values=torch.cat(values, dim=2), layers=layers, gain=gain,
                   positions=torch.cat(positions) if placement == "before" else None,
                   provenance=provenance)


def _carries_content(text: str, start: int, end: int) -> bool:
    """The token ``text[start:end]`` has a letter or digit and is not a function word (a
    subword of a longer word counts as content: its word is looked up whole)."""
    piece = text[start:end]
    if not any(c.isalnum() for c in piece):
        return False
    while start > 0 and text[start - 1].isalnum():
        start -= 1
    while end < len(text) and text[end].isalnum():
        end += 1
    return text[start:end].strip().lower() not in FUNCTION_WORDS


def render_in_context(tokenizer, wrapped: str, context: str) -> tuple[str, int]:
    """``wrapped`` placed in ``context`` (see :meth:`MemoryBank.from_text`): the rendered text and
    the character offset at which ``wrapped`` starts in it."""
    if context == "none":
        return wrapped, 0
    if context == "bos":
        if not tokenizer.bos_token:
            raise ValueError("context='bos' needs a tokenizer with a BOS token; this one has "
                             "none (use 'system', 'user' or 'none')")
        return tokenizer.bos_token + wrapped, len(tokenizer.bos_token)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"context={context!r} needs a tokenizer with a chat template; this one "
                         "has none (use 'bos' or 'none')")
    messages = ([{"role": "system", "content": wrapped}] if context == "system"
                else chat_messages(wrapped))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    offset = rendered.rfind(wrapped)
    if offset < 0:
        raise ValueError(f"the chat template does not render the text verbatim in a {context} "
                         "message; use context='bos' or 'none'")
    return rendered, offset
