"""The `titanrl` subcommands other than `train`: export, eval, plot, rollouts (the config field help
is `titanrl.config.help`)."""

from __future__ import annotations


class CommandError(ValueError):
    """A command's input cannot be used (missing run, occupied output, no eval file); the
    message says what to change. The CLI prints it and exits with status 2."""
