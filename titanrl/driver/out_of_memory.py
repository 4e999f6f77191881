"""Recognising a run that died of memory, and saying which settings lower it.

Ray's memory monitor ends a worker process when the node nears full memory (the caller sees
`ray.exceptions.OutOfMemoryError`, or an actor death whose message names the node running out
of memory); the kernel's OOM killer sends SIGKILL, which Ray reports naming the OOM killer as
a likely cause. Either way the user needs the same thing: the settings that shrink each side.
"""

from __future__ import annotations

import re

_MARKERS = re.compile(r"out of memory|\bOOM\b|NODE_OUT_OF_MEMORY|memory pressure", re.IGNORECASE)

MEMORY_SETTINGS = (
    "The 'auto' memory settings were chosen from the memory plan printed at start-up; an explicit "
    "value replaces a choice. Settings that lower memory: for the trainer, train.memory.micro_batch_size (activations), "
    "train.memory.activation_checkpointing='full' (stored activations), train.memory.logprob_chunk_tokens "
    "(logits), train.parallel.* (shards across processes; `titanrl plan` estimates each rank's "
    "share); for each rollout worker, rollout.engine.kv_cache_gib and rollout.engine.max_num_seqs; and "
    "rollout.num_workers."
)


def caused_by_memory(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from, says a process ran out of memory."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "OutOfMemoryError" or _MARKERS.search(str(e)):
            return True  # ray.exceptions.OutOfMemoryError and torch.OutOfMemoryError alike
        e = e.__cause__ or e.__context__
    return False


def memory_hint(error: BaseException) -> str:
    """'' or a sentence to append to the failure message when `error` looks like out of memory."""
    if not caused_by_memory(error):
        return ""
    return f" This looks like the machine ran out of memory. {MEMORY_SETTINGS}"
