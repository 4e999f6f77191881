"""Records, per request, the experts our MoE model routed each token through inside vLLM.

Router replay (the trainer routing a sample's tokens through the experts the generator chose)
needs, for every sequence position and sparse layer, the generator's top-k. vLLM 0.32's own
`enable_return_routed_experts` would bind our routers (they have `layer_id`), but it needs Model
Runner V2, which needs Triton with a CPU backend: refused on this CPU build ("Model Runner V2
requires Triton"). So the recorder lives in the worker, beside our model:

- every sparse layer's `Router.capture` hook copies the step's chosen experts `[N, k]` into one
  preallocated step buffer `[N, layers, k]` (no per-request work inside the forward);
- after the forward, the step's rows are split by request (vLLM lays the flattened batch out in
  `input_batch.req_ids` order, request i's tokens at `query_start_loc[i]:query_start_loc[i+1]`)
  and stored at their positions in that request's buffer, sized `prompt + max_tokens` when the
  request is first seen;
- only requests that carry a key (`SamplingParams.extra_args[ROUTING_KEY]`, set by `VllmEngine`)
  are recorded; the engine takes a finished request's buffer by that key (`take`).

Positions never computed stay -1: prompt tokens served from the prefix cache and the final
sampled token (never fed back). A position computed twice (a preempted request recomputed, e.g.
after a weight push with `recompute_running`) keeps the latest routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from titanrl.models.qwen3.moe import Router

ROUTING_KEY = "titanrl_routing_key"
"""`SamplingParams.extra_args` key naming the record a request's routing goes into."""

NOT_RECORDED = -1
"""Expert id of a position whose routing was not recorded (the trainer routes it live)."""

BatchView = Callable[[], tuple[list[str | None], dict[str, Any]]]
"""Returns the running batch: request ids in batch order, and the runner's request states by id."""


class RoutingRecorder:
    """Hooks the routers of one model and keeps each keyed request's routing `[positions, layers, k]`."""

    def __init__(self, routers: list[Router], batch: BatchView) -> None:
        if not routers:
            raise ValueError("routing capture needs a model with sparse layers (routers)")
        self.routers, self.batch = routers, batch
        self.layer_slot = {router.layer_id: i for i, router in enumerate(routers)}
        """Router layer id -> its index among the sparse layers (the record's second axis)."""
        self.top_k = routers[0].top_k
        self._step = torch.empty(0, len(routers), self.top_k, dtype=torch.int16)
        self._tokens = 0
        self.records: dict[str, np.ndarray] = {}
        """Key -> int16 [capacity, sparse layers, k]; -1 where not recorded."""
        self._keys: dict[str, str] = {}
        """vLLM request id -> its record key (recorded requests only)."""
        for router in routers:
            router.capture = self._capture

    def detach(self) -> None:
        """Unhooks the routers (nothing more is recorded)."""
        for router in self.routers:
            router.capture = None

    # --- inside a forward -------------------------------------------------------------------
    def begin(self, num_tokens: int) -> None:
        """Called before a forward of `num_tokens` flattened tokens (0: nothing is recorded)."""
        self._tokens = num_tokens
        if self._step.shape[0] < num_tokens:
            self._step = torch.empty(num_tokens, len(self.routers), self.top_k, dtype=torch.int16)

    def _capture(self, layer_id: int, experts_NK: torch.Tensor) -> None:
        if self._tokens:
            self._step[: self._tokens, self.layer_slot[layer_id]].copy_(experts_NK[: self._tokens])

    def end(self, positions_N: torch.Tensor, query_start_loc: torch.Tensor) -> None:
        """Stores the step's routing per request, at each token's position."""
        n, self._tokens = self._tokens, 0
        if not n:
            return
        req_ids, states = self.batch()
        starts = query_start_loc.tolist()
        step, positions = self._step[:n].numpy(), positions_N[:n].cpu().numpy()
        for r, req_id in enumerate(req_ids[: len(starts) - 1]):
            if req_id is None or starts[r] == starts[r + 1]:
                continue
            key = self._key(req_id, states.get(req_id))
            if key is None:
                continue
            rows = slice(starts[r], starts[r + 1])
            self._buffer(key, req_id, states[req_id], int(positions[rows].max()) + 1)[positions[rows]] = step[rows]

    def _key(self, req_id: str, state: Any) -> str | None:
        key = self._keys.get(req_id)
        if key is None and state is not None:
            extra = getattr(state.sampling_params, "extra_args", None) or {}
            key = extra.get(ROUTING_KEY)
            if key is not None:
                self._keys[req_id] = key = str(key)
        return key

    def _buffer(self, key: str, req_id: str, state: Any, length: int) -> np.ndarray:
        buf = self.records.get(key)
        if buf is None or buf.shape[0] < length:
            params = state.sampling_params
            capacity = max(length, len(state.prompt_token_ids or ()) + int(params.max_tokens or 0))
            grown = np.full((capacity, len(self.routers), self.top_k), NOT_RECORDED, dtype=np.int16)
            if buf is not None:
                grown[: buf.shape[0]] = buf
            self.records[key] = buf = grown
        return buf

    # --- after generation -------------------------------------------------------------------
    def take(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Removes and returns the records of `keys` (a key never recorded is absent)."""
        keys = set(keys)
        for req_id in [r for r, k in self._keys.items() if k in keys]:
            del self._keys[req_id]
        return {k: self.records.pop(k) for k in keys if k in self.records}


def fit_routing(record: np.ndarray | None, length: int, num_layers: int, top_k: int) -> np.ndarray:
    """A request's record cut or padded (with -1) to `length` positions; all -1 if none came back."""
    out = np.full((length, num_layers, top_k), NOT_RECORDED, dtype=np.int16)
    if record is not None:
        n = min(length, record.shape[0])
        out[:n] = record[:n]
    return out


def merge_routing(earlier: np.ndarray | None, later: np.ndarray) -> np.ndarray:
    """One sequence's routing from two requests over its prefixes (an episode's turns): `later`'s
    rows where recorded, `earlier`'s where `later` has none (prefix-cache hits); `later`'s length."""
    if earlier is None:
        return later
    n = min(len(earlier), len(later))
    out = later.copy()
    missing = (out[:n] < 0).any(axis=(1, 2))
    out[:n][missing] = earlier[:n][missing]
    return out
