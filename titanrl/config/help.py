"""`titanrl train --help`'s config part: every RunConfig field as tyro renders it.

tyro reads each field's docstring (the string literal after it in config/schema.py) and shows
`--section.key TYPE`, the docstring and the default; Literal fields list their choices.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import textwrap
import warnings
from collections.abc import Iterator

from titanrl.config.schema import RunConfig

HEADER = (
    "config overrides (--section.key=value or --section.key value, applied on top of CONFIG.py; the "
    "defaults shown are CONFIG.py's when it is given): bools take true/false (yes/no, on/off, 1/0); "
    "'X | None' fields take none or null; tuples and lists take comma-separated items: "
    "--train.optimizer.betas=0.9,0.95, --rewards=pkg.mod:fn,pkg.mod:fn2, --env.factory=pkg.mod:make_env."
)

_OPTIONS_GROUP = re.compile(r"^\W*options\b")
"""tyro's first group, the top-level fields: ' options' (plain) or '╭─ options ──' (a terminal)."""


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """tyro lays help out for the terminal's width: cap it at `width` while it renders."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(min(shutil.get_terminal_size().columns, width))
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def config_help(config: RunConfig | None = None, width: int = 100) -> str:
    """The help text of every field of `config` (default: RunConfig()), its values as the defaults."""
    import tyro

    from titanrl.config.overrides import TYRO_OPTIONS, without_rows

    out = io.StringIO()
    with _columns(width), contextlib.redirect_stdout(out), contextlib.suppress(SystemExit), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a mistyped value in CONFIG.py: validate names it
        tyro.cli(RunConfig, default=without_rows(config or RunConfig())[0], args=["--help"], prog="titanrl",
                 **TYRO_OPTIONS)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    # tyro's usage line and RunConfig's docstring come before the first group (the command has its
    # own usage); its -h entry repeats the command's own.
    lines = lines[next((i for i, line in enumerate(lines) if _OPTIONS_GROUP.match(line)), 0):]
    if (at := next((i for i, line in enumerate(lines) if line.strip() == "-h, --help"), None)) is not None:
        del lines[at:at + 2]
    return "\n".join([*textwrap.wrap(HEADER, width=width), "", *lines]).strip("\n")
