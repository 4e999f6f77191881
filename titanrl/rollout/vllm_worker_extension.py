"""Methods vLLM mixes into its worker class (`worker_extension_cls`) for in-place weight pushes.

Reached from the driver with `llm.collective_rpc("titanrl_update_weights", args=(...))`.
The in-process engine passes the tensors themselves; the multiprocess engine passes plain
bytes (a `safetensors.torch.save` blob) because tensors in `collective_rpc` arguments do not
survive its serialisation.
vLLM refuses extension attributes that clash with the worker's, hence the `titanrl_` prefix.
"""

from __future__ import annotations

import time

import torch
from safetensors.torch import load as load_safetensors_bytes

EXTENSION_QUALNAME = "titanrl.rollout.vllm_worker_extension.TitanRLWorkerExtension"


def _find_titan_model(root: torch.nn.Module) -> torch.nn.Module:
    from titanrl.rollout.vllm_model import TitanQwen3ForVLLM

    for module in root.modules():  # the runner may wrap the model
        if isinstance(module, TitanQwen3ForVLLM):
            return module
    raise TypeError(
        f"the vLLM model is {type(root).__name__}, not TitanRL's: create the engine with "
        "hf_overrides={'architectures': ['TitanRLQwen3ForCausalLM']}"
    )


class TitanRLWorkerExtension:
    """Mixed into vLLM's worker; `self` is the worker (has `get_model()`)."""

    def titanrl_update_weights(
        self, payload: bytes | dict[str, torch.Tensor], version: int, allow_partial: bool = False
    ) -> dict:
        """Copies the tensors in `payload` into the running model's parameters in place.

        Unless `allow_partial`, every parameter must be present (a tied LM head counts as
        the embedding). Returns the version now loaded and how long the copy took.
        """
        t0 = time.perf_counter()
        state = payload if isinstance(payload, dict) else load_safetensors_bytes(payload)
        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        expected = {name for name, _ in model.named_parameters()}
        missing = expected - set(state)
        if missing and not allow_partial:
            raise KeyError(f"weight push is missing {len(missing)} parameter(s), e.g. {sorted(missing)[:3]}")
        loaded = model.load_weights(state.items())
        self._titanrl_policy_version = int(version)
        return {"version": int(version), "num_tensors": len(loaded), "seconds": time.perf_counter() - t0}

    def titanrl_policy_version(self) -> int | None:
        """The version of the last push this worker applied (None before the first)."""
        return getattr(self, "_titanrl_policy_version", None)

    def titanrl_state_dict_bytes(self) -> bytes:
        """The running model's weights as a safetensors blob (for tests and debugging)."""
        from safetensors.torch import save

        model = _find_titan_model(self.get_model())  # type: ignore[attr-defined]
        return save({name: p.detach().contiguous() for name, p in model.named_parameters()})
