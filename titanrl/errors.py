"""Errors a run raises to its caller (kept import-light: `import titanrl` must stay cheap)."""


class RunStopped(RuntimeError):
    """The run stopped before its last step; the message says why and where its checkpoint is."""


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and the fix."""
