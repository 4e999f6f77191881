"""Methods vLLM mixes into its worker class (`worker_extension_cls`) for in-place weight pushes.

Reached from the driver with `llm.collective_rpc("titanrl_update_weights", args=(...))`.
The in-process engine passes the tensors themselves. Tensors in `collective_rpc` arguments do
not survive the multiprocess engine's serialisation, so there the tensors come through shared
memory or a broadcast group (`titanrl.weight_sync`) that this process maps or joins itself;
`titanrl_update_weights` still accepts a `safetensors.torch.save` blob.
vLLM refuses extension attributes that clash with the worker's, hence the `titanrl_` prefix.
"""

from __future__ import annotations

import time

import torch
from safetensors.torch import load as load_safetensors_bytes

EXTENSION_QUALNAME = "titanrl.rollout.vllm.worker_extension.TitanRLWorkerExtension"


def _find_titan_model(root: torch.nn.Module) -> torch.nn.Module:
    from titanrl.rollout.vllm.model import VllmModelBoundary

    for module in root.modules():  # the runner may wrap the model
        if isinstance(module, VllmModelBoundary):
            return module
    raise TypeError(
        f"the vLLM model is {type(root).__name__}, not TitanRL's: create the engine with "
        "hf_overrides={'architectures': [a ModelSpec.vllm_architecture]}"
    )


class TitanRLWorkerExtension:
    """Mixed into vLLM's worker; `self` is the worker (has `get_model()`)."""

    def _titanrl_pushed(self, model: torch.nn.Module, version: int) -> None:
        """The end of every push, whatever the transport: kernels that keep packed copies of the
        weights repack them (see titanrl.models.common.vllm_kernels), then the version is recorded."""
        model.process_weights_after_loading()
        self._titanrl_policy_version = int(version)

    def titanrl_update_weights(
        self, payload: bytes | dict[str, torch.Tensor], version: int, allow_partial: bool = False
    ) -> dict:
        """Copies the tensors in `payload` into the running model's parameters in place.

        Unless `allow_partial`, every parameter must be present (a tied LM head counts as
        the embedding). Returns the version now loaded and how long the copy took.
        """
        from titanrl.weight_sync.layout import layout_of
        from titanrl.weight_sync.target import ParameterTarget

        t0 = time.perf_counter()
        state = payload if isinstance(payload, dict) else load_safetensors_bytes(payload)
        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        # Names and shapes all checked before the first copy: a bad push never half-loads.
        target = ParameterTarget(model)
        target.check(layout_of(state.items()), allow_partial)
        self._titanrl_unshare(target)  # load_weights writes in place
        loaded = model.load_weights(state.items())
        self._titanrl_pushed(model, version)
        return {"version": int(version), "num_tensors": len(loaded), "seconds": time.perf_counter() - t0}

    def _titanrl_unshare(self, target) -> None:
        """Parameters that view a shared-memory segment (zero-copy loads) get memory of their
        own before anything writes them in place: every receiver maps the same segment."""
        cache = getattr(self, "_titanrl_segments", None)
        if cache is not None and cache.pinned:
            cache.make_private(target.tensors())

    def titanrl_policy_version(self) -> int | None:
        """The version of the last push this worker applied (None before the first)."""
        return getattr(self, "_titanrl_policy_version", None)

    def titanrl_state_dict_bytes(self) -> bytes:
        """The running model's weights as a safetensors blob (for tests and debugging)."""
        from safetensors.torch import save

        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        return save({name: p.detach().contiguous() for name, p in model.named_parameters()})

    # --- routing capture (MoE): see titanrl.rollout.vllm.routing_record ------------------------

    def titanrl_record_routing(self, enabled: bool) -> int:
        """Starts (or stops) recording the routing of keyed requests; returns the sparse layer count."""
        from titanrl.models.architectures import spec_for
        from titanrl.rollout.vllm.routing_record import RoutingRecorder

        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        if not spec_for(model.config).is_moe:
            raise TypeError(f"routing capture needs a mixture-of-experts model, the engine runs {type(model).__name__}")
        if model.routing_recorder is not None:
            model.routing_recorder.detach()
            model.routing_recorder = None
        if enabled:
            runner = self.model_runner  # type: ignore[attr-defined]
            model.routing_recorder = RoutingRecorder(
                model.routers(), lambda: (runner.input_batch.req_ids, runner.requests))
        return len(model.routers())

    def titanrl_take_routed_experts(self, keys: list[str]) -> dict[str, tuple[list[int], bytes]]:
        """Removes and returns the records of `keys` as (shape, int16 bytes): plain data crosses
        the multiprocess engine's serialisation, tensors and arrays need not."""
        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        recorder = getattr(model, "routing_recorder", None)
        if recorder is None:
            return {}
        return {k: (list(v.shape), v.tobytes()) for k, v in recorder.take(keys).items()}

    # --- weight transports (titanrl.weight_sync): the bytes land in this process ---------------

    def titanrl_load_shared_memory(self, announcement: dict, version: int, rank: int,
                                   allow_partial: bool = False, zero_copy: bool = False) -> dict:
        """Loads a shared-memory announcement's tensors from the mapped segment into the parameters
        (`zero_copy`: as views of the segment where dtype and shape match; see load_from_segment)."""
        from titanrl.weight_sync.announcement import WeightAnnouncement
        from titanrl.weight_sync.shared_memory import SegmentCache, load_from_segment
        from titanrl.weight_sync.target import ParameterTarget

        t0 = time.perf_counter()
        ann = WeightAnnouncement.from_wire(announcement)
        if ann.version != int(version):
            from titanrl.weight_sync.layout import WeightSyncError

            raise WeightSyncError(f"the announcement is for version {ann.version}, the push says {version}")
        if getattr(self, "_titanrl_segments", None) is None:
            self._titanrl_segments = SegmentCache()
        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        n, views = load_from_segment(ParameterTarget(model), ann, int(rank), self._titanrl_segments, allow_partial,
                                     bool(zero_copy))
        self._titanrl_pushed(model, version)
        return {"version": int(version), "num_tensors": n, "views": views, "seconds": time.perf_counter() - t0}

    def titanrl_open_weight_group(self, plan: dict, rank: int) -> None:
        """Joins the trainer's broadcast group as `rank` (blocks until every member has joined)."""
        from titanrl.weight_sync.broadcast import BroadcastGroup
        from titanrl.weight_sync.plan import WeightSyncPlan

        self.titanrl_close_weight_sync([], segments=False)
        self._titanrl_group = BroadcastGroup(WeightSyncPlan.from_wire(plan), int(rank))

    def titanrl_receive_broadcast(self, announcement: dict, version: int) -> dict:
        """Receives a broadcast push bucket by bucket, writing each into the parameters."""
        from titanrl.weight_sync.announcement import WeightAnnouncement
        from titanrl.weight_sync.broadcast import receive_broadcast
        from titanrl.weight_sync.layout import WeightSyncError
        from titanrl.weight_sync.target import ParameterTarget

        t0 = time.perf_counter()
        group = getattr(self, "_titanrl_group", None)
        if group is None:
            raise WeightSyncError("no broadcast group: open_weight_sync(plan, rank) first")
        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        target = ParameterTarget(model)
        self._titanrl_unshare(target)  # the broadcast writes in place
        n = receive_broadcast(group, target, WeightAnnouncement.from_wire(announcement), int(version))
        self._titanrl_pushed(model, version)
        return {"version": int(version), "num_tensors": n, "seconds": time.perf_counter() - t0}

    def titanrl_close_weight_sync(self, keep: list, segments: bool = True) -> None:
        """Leaves the broadcast group and unmaps segments, except those of the senders in `keep`."""
        group = getattr(self, "_titanrl_group", None)
        if group is not None:
            self._titanrl_group = None
            group.close()
        cache = getattr(self, "_titanrl_segments", None)
        if segments and cache is not None:
            from titanrl.weight_sync.target import ParameterTarget

            params = None
            if cache.pinned:  # Parameters still viewing a departing sender's segment are copied out first
                params = ParameterTarget(_find_titan_model(self.get_model())).tensors()  # type: ignore[attr-defined]
            cache.close(keep=set(keep), params=params)
