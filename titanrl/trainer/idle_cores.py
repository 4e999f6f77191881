"""`train.compute.threads_when_rollouts_idle`: the trainer takes the cores of rollout workers that wait.

With `train.max_staleness >= 1` the trainer trains step k while the workers sample step k+1;
each worker then waits for the weights of step k+1 and its cores sit idle for the rest of the
step. A fixed thread count either leaves those cores idle (`threads` = the cores the workers
leave free) or oversubscribes the machine while the workers sample (`threads` = all cores:
OpenMP threads that spin for a core the engine holds). On a 2-core EPYC, issue 21's 19M run
(benchmarks/vs_trl.py, a 1-thread worker) took 8.8 s per step switching between 1 and 2 threads
against 9.2 s with 2 (whose trainer slowed generation from 4.8 to 6.1 s per batch).

`IdleCores` reads the workers' busy bytes (`titanrl.busy_flags`) before each decoder layer's
attention, forward and backward, and sets torch's intra-op threads to `threads` while any worker
samples, `idle_threads` while none does. The check runs eagerly inside a compiled block
(`torch.compiler.disable`; the attention backend is eager there anyway: `parallel.compile`).
OpenMP's thread count is per calling thread, so it is set on the thread that runs the ops:
the forward's, which on CPU also runs the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from titanrl.busy_flags import BusyFlags



class IdleCores:
    """Switches this thread's torch threads between `threads` (a worker is generating) and
    `idle_threads` (none is); counts how often it found the workers idle."""

    def __init__(self, flags: BusyFlags, threads: int, idle_threads: int) -> None:
        self.flags, self.threads, self.idle_threads = flags, threads, idle_threads
        self.current = torch.get_num_threads()
        self.checks = 0
        self.idle_checks = 0

    def check(self) -> None:
        """Sets the thread count the workers' state asks for (a no-op when it is already that).
        Called eagerly: from the compile-disabled layer wrapper, its grad hook, or between steps."""
        idle = not self.flags.any_busy()
        want = self.idle_threads if idle else self.threads
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        self.checks += 1
        self.idle_checks += idle

    def install(self, layers: Sequence[nn.Module], polled_part: str) -> None:
        """Checks before the forward and the backward of each layer's `polled_part` (the family's
        attention core, `ParallelPlan.attention_core`)."""
        for layer in layers:
            part = layer.get_submodule(polled_part)
            part.forward = _checked(part.forward, self.check)  # on the instance: names unchanged

    def take_idle_fraction(self) -> float:
        """The share of checks since the last call that found every worker idle (NaN: none ran)."""
        frac = self.idle_checks / self.checks if self.checks else float("nan")
        self.checks = self.idle_checks = 0
        return frac


def _checked(forward: Callable[..., torch.Tensor], check: Callable[[], None]) -> Callable[..., torch.Tensor]:
    @torch.compiler.disable
    @functools.wraps(forward)
    def forward_after_check(*args: Any, **kwargs: Any) -> torch.Tensor:
        check()
        out = forward(*args, **kwargs)
        if out.requires_grad:  # the layer's backward reaches this output first: check there too
            out.register_hook(lambda grad: check())
        return out

    return forward_after_check
