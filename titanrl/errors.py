"""Errors a run raises to its caller (kept import-light: `import titanrl` must stay cheap)."""


class RunStopped(RuntimeError):
    """The run stopped before its last step; the message says why and where its checkpoint is."""


class TrainerLost(RunStopped):
    """The trainer's actor died (its process or its node): the run stopped, saved; with
    `train.auto_resume` the driver resumes it when the cluster has room again."""


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and the fix."""


class RunTerminated(SystemExit):
    """The run got SIGTERM (preemption: SLURM, Kubernetes, `kill`): the last completed step was
    saved and the actors shut down. A `SystemExit` with status 143 (128 + SIGTERM), so an
    uncaught one ends the process as a terminated process ends; the message is `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(143)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason
