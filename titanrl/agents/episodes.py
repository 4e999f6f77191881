"""Live agent episodes and the bearer tokens that route each endpoint call to its episode.

An episode's `fn` gets the api_key `<run token>.<episode id>`: the run token (random, per runner)
proves the call comes from this run's agents, and the episode id files the call under its
episode. A key whose episode has ended (returned, raised or timed out) is refused, so a
harness that keeps calling after its episode was given up cannot add tokens to it.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any

from titanrl.agents.calls import CallRecord


class EndpointError(Exception):
    """A refused request: becomes an OpenAI-style JSON error with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class AgentEpisode:
    """One running call of the agent function, and every endpoint call it made."""

    episode_id: str
    row: dict[str, Any]
    seed: int | None
    """Seed of its first sampled choice (each later choice takes the next); None: unseeded."""
    greedy: bool
    """An evaluation episode: every call is sampled at temperature 0."""
    generator: Any
    """The `AsyncGenerator` its calls run on."""
    calls: list[CallRecord] = field(default_factory=list)
    """Every choice of every call, in order."""
    num_calls: int = 0
    """Calls made (a call of n choices counts once)."""
    resampled_calls: int = 0
    """Calls sampled again because new weights arrived while they ran (a call never spans two versions)."""
    open: bool = True
    """False once `fn` returned, raised or timed out: later calls are refused."""
    engine_error: BaseException | None = None
    """What the engine raised into one of its calls: not the agent's failure but the worker's
    (the runner re-raises it, as an environment episode's engine errors propagate)."""

    @property
    def choices(self) -> int:
        return len(self.calls)


class EpisodeRegistry:
    """The episodes whose calls the endpoint accepts, by api_key."""

    def __init__(self) -> None:
        self.token = secrets.token_urlsafe(24)
        """This runner's run token, the first part of every api_key it hands out."""
        self._ids = itertools.count()
        self._live: dict[str, AgentEpisode] = {}

    def open(self, row: dict[str, Any], seed: int | None, greedy: bool, generator: Any) -> tuple[AgentEpisode, str]:
        """A new live episode and its api_key."""
        episode = AgentEpisode(f"ep{next(self._ids)}", row, seed, greedy, generator)
        self._live[episode.episode_id] = episode
        return episode, f"{self.token}.{episode.episode_id}"

    def close(self, episode: AgentEpisode) -> None:
        episode.open = False
        self._live.pop(episode.episode_id, None)

    def authorize(self, authorization: str | None) -> AgentEpisode:
        """The live episode an `Authorization: Bearer <key>` header names; 401 otherwise."""
        if not authorization or not authorization.startswith("Bearer "):
            raise EndpointError(401, "missing bearer token: send 'Authorization: Bearer <api_key>' with the "
                                "api_key the agent function was given", type="authentication_error",
                                code="invalid_api_key")
        key = authorization[len("Bearer "):].strip()
        token, _, episode_id = key.rpartition(".")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise EndpointError(401, "invalid api_key: use the api_key the agent function was given",
                                type="authentication_error", code="invalid_api_key")
        episode = self._live.get(episode_id)
        if episode is None:
            raise EndpointError(401, f"episode {episode_id!r} is not running (it ended, timed out or never "
                                "started): its calls are no longer accepted", type="authentication_error",
                                code="episode_closed")
        return episode
