"""Likelihood probes: how much more a (steered) model expects one reply than its opposite.

A contrast pair is ``(prompt, target_reply, reference_reply)``. Its margin is
log p(target_reply | prompt) − log p(reference_reply | prompt), each reply scored token by token
as the assistant's turn after the chat-templated prompt. The shift of the margin under a steering
method, against the plain model, is how far the method moved the model towards the target: a
signal that small models give reliably where their free text is too noisy to judge.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from hf_memory.chat.generation import assistant_prefix_length, chat_messages
from hf_memory.metrics.plain_states import PlainStates, left_padded

__all__ = ["ContrastPair", "check_pairs", "log_probabilities", "pair_margins", "reply_logprobs"]

ContrastPair = tuple[str, str, str]


def check_pairs(pairs: Sequence[ContrastPair]) -> None:
    """Raise a ValueError naming the problem unless ``pairs`` are non-empty string triples."""
    if isinstance(pairs, str) or not pairs:
        raise ValueError("contrast pairs must be a non-empty sequence of (prompt, target, "
                         "reference) triples")
    for pair in pairs:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 3
                or not all(isinstance(x, str) and x.strip() for x in pair)):
            raise ValueError(f"a contrast pair is (prompt, target reply, reference reply), three "
                             f"non-empty strings; got {pair!r}")


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities in at least float32 (float64 models keep float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)


@torch.no_grad()
def reply_logprobs(model: nn.Module, tokenizer, conversations: Sequence[list[dict[str, str]]],
                   replies: Sequence[str], *, method=None, batch_size: int = 16,
                   plain_states: PlainStates | None = None) -> torch.Tensor:
    """Summed log-probability of each reply as the assistant's answer to its conversation.

    Rows are left-padded into batches of ``batch_size``, each row's positions counted from its
    first real token as ``generate()`` counts them (so slots placed at positions before the
    conversation sit as far from a row's tokens whatever its padding). ``method`` (anything with
    ``attach(model, instruction_end)``, e.g. a :class:`~hf_memory.baselines.methods.Method`) is
    held around
    each batch; ``instruction_end`` is a ``[B]`` tensor: where each row's user turn ends.
    ``plain_states`` (:class:`~hf_memory.metrics.plain_states.PlainStates`): a plain call
    (``method=None``) on an empty one records the plain stream of these rows; a later steered
    call on the same rows starts each batch at the steering's lowest kept layer (the same
    logits). Returns ``[N]`` float64.
    """
    if len(conversations) != len(replies):
        raise ValueError("one reply per conversation")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    prefix = assistant_prefix_length(tokenizer)
    rows = []
    for messages, reply in zip(conversations, replies, strict=True):
        head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        head_ids = tokenizer(head, add_special_tokens=False).input_ids
        reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
        if not reply_ids:
            raise ValueError(f"reply {reply!r} encodes to no tokens")
        rows.append((head_ids, reply_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    recording = plain_states is not None and method is None and not plain_states.recorded
    record_layers = plain_states.plan([h + r for h, r in rows]) if recording else ()
    reusing = plain_states is not None and method is not None and plain_states.recorded
    scores = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        joined = [tuple(h + r) for h, r in chunk]
        ids, mask, positions = left_padded(joined, pad, device)
        width = ids.shape[1]
        ends = torch.tensor([width - len(r) - prefix for _, r in chunk], device=device)
        keep = max(len(r) for _, r in chunk) + 1  # logits of the reply positions only
        with method.attach(model, ends) if method is not None else nullcontext() as context:
            first = plain_states.start(context, joined) if reusing else 0
            if first:
                logits = plain_states.logits(first, joined, mask, positions, keep)
            else:
                output = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                               logits_to_keep=keep, output_hidden_states=bool(record_layers))
                logits = output.logits
                if record_layers:
                    plain_states.record(joined, output.hidden_states, record_layers)
        logprobs = log_probabilities(logits)
        for i, (_, reply_ids) in enumerate(chunk):
            n = len(reply_ids)
            picked = logprobs[i, keep - n - 1:keep - 1].gather(-1, ids[i, width - n:, None])
            scores.append(picked.double().sum().item())
    if recording:
        plain_states.finish(record_layers)
    return torch.tensor(scores, dtype=torch.float64)


def pair_margins(model: nn.Module, tokenizer, pairs: Sequence[ContrastPair], *, method=None,
                 batch_size: int = 16, plain_states: PlainStates | None = None) -> torch.Tensor:
    """``[N]`` margins log p(target) − log p(reference) of each pair's replies to its prompt.

    ``method`` decides how the prompt is presented (``method.messages(prompt)``) and what is
    attached while scoring; None scores the plain model (or whatever steering is active).
    ``plain_states``: as :func:`reply_logprobs`.
    """
    check_pairs(pairs)
    conversations = [method.messages(p) if method is not None else chat_messages(p)
                     for p, _, _ in pairs]
    both = reply_logprobs(model, tokenizer, [c for c in conversations for _ in (0, 1)],
                          [r for _, target, reference in pairs for r in (target, reference)],
                          method=method, batch_size=batch_size, plain_states=plain_states)
    return both[0::2] - both[1::2]
