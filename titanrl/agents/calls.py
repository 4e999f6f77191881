"""What the endpoint records per call, and the one rule that turns an episode's calls into samples.

Every call is recorded token for token: the prompt ids the engine consumed, the completion ids it
sampled, their logprobs and the policy version that sampled them. Nothing is re-tokenized
afterwards; the samples are assembled from these ids alone.

**The rule.** Calls are taken in the order they were made (the choices of an n > 1 call one after
another). A call *extends* a sample when its prompt ids begin with that sample's whole token
sequence so far (the first call's prompt, then every completion and everything inserted between
them); the call's extra prompt tokens (the harness's tool results, the template's turn markers)
are appended with loss mask 0 and its completion with loss mask 1. A call that extends no sample
starts a new one: a harness that re-renders history so that it no longer matches what was sampled
(different whitespace, a dropped reasoning block, a summarised transcript) gets one sample per
piece, never a splice of tokens the model did not produce after each other. Such a call, other
than a sibling choice of the same request, is counted as a prefix break. Every sample of an
episode carries the episode's reward; in GRPO's group statistics each counts as one sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CallRecord:
    """One choice of one endpoint call, exactly as the engine produced it."""

    call_index: int
    """Which call of the episode (0, 1, ...); the choices of one call share it."""
    prompt_ids: list[int]
    """The prompt token ids the engine consumed."""
    completion_ids: list[int]
    """The token ids it sampled (a stop token included)."""
    logprobs: list[float]
    """The sampling log-probability of each completion token."""
    version: int
    """The policy version that sampled every token of it (a call never spans two: `AgentRunner`)."""
    text: str
    """The decoded completion (stop strings included), for transcripts."""
    finished: bool
    """False when it hit max_tokens instead of stopping."""


@dataclass
class EpisodePiece:
    """One training sample's tokens, assembled from consecutive calls that extend each other."""

    prompt_ids: list[int]
    """The first call's prompt."""
    completion_ids: list[int] = field(default_factory=list)
    """Every later token: completions (mask 1) and the inserted tokens between them (mask 0)."""
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Sampling logprobs of completion tokens; 0.0 for inserted ones."""
    versions: list[int] = field(default_factory=list)
    """Per completion-side token, the version that sampled it (inserted tokens: the previous token's)."""
    transcript: list[dict[str, str]] = field(default_factory=list)
    """`{"role": "model" | "env", "text": ...}` in order; the texts joined are the completion text."""
    calls: int = 0
    """How many calls it is made of."""
    finished: bool = True
    """Whether its last call stopped (rather than hitting max_tokens)."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def extend(self, call: CallRecord, inserted: list[int], inserted_text: str) -> None:
        if inserted:
            self.completion_ids += inserted
            self.loss_mask += [0] * len(inserted)
            self.logprobs += [0.0] * len(inserted)
            self.versions += [self.versions[-1] if self.versions else call.version] * len(inserted)
            self.transcript.append({"role": "env", "text": inserted_text})
        self.completion_ids += call.completion_ids
        self.loss_mask += [1] * len(call.completion_ids)
        self.logprobs += call.logprobs
        self.versions += [call.version] * len(call.completion_ids)
        self.transcript.append({"role": "model", "text": call.text})
        self.calls += 1
        self.finished = call.finished


@dataclass
class EpisodePieces:
    """An episode's samples and what assembling them saw."""

    pieces: list[EpisodePiece]
    prefix_breaks: int
    """Calls (other than sibling choices) that extended none of the episode's samples."""


def assemble(calls: list[CallRecord], decode: Callable[[list[int]], str], *,
             check_prefix: bool = True) -> EpisodePieces:
    """Samples of one episode by the module's rule. `decode` turns inserted ids into their text
    (transcripts only). `check_prefix=False` is the unsafe splice the rule exists to prevent (each
    call's prompt tail is appended after the previous completion whatever it holds); only tests
    use it, as the negative control."""
    pieces: list[EpisodePiece] = []
    breaks = 0
    for i, call in enumerate(calls):
        extended = _longest_extended(pieces, call.prompt_ids)
        if extended is None and not check_prefix and pieces:
            extended = pieces[-1]
            inserted = call.prompt_ids[min(len(pieces[-1].tokens), len(call.prompt_ids)):]
            extended.extend(call, inserted, decode(inserted))
            continue
        if extended is None:
            sibling = i > 0 and calls[i - 1].call_index == call.call_index  # choice 1.. of an n > 1 call
            breaks += bool(pieces) and not sibling
            piece = EpisodePiece(prompt_ids=list(call.prompt_ids))
            piece.extend(call, [], "")
            pieces.append(piece)
            continue
        inserted = call.prompt_ids[len(extended.tokens):]
        extended.extend(call, inserted, decode(inserted))
    return EpisodePieces(pieces, breaks)


def _longest_extended(pieces: list[EpisodePiece], prompt_ids: list[int]) -> EpisodePiece | None:
    """The piece whose whole token sequence `prompt_ids` begins with (the longest such), if any."""
    best = None
    for piece in pieces:
        tokens = piece.tokens
        extends = len(tokens) <= len(prompt_ids) and prompt_ids[: len(tokens)] == tokens
        if extends and (best is None or len(tokens) > len(best.tokens)):
            best = piece
    return best
