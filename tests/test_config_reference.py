"""docs/config-reference.md is the generator's output for today's config dataclasses."""

from pathlib import Path

from titanrl.config.reference import COMMAND, config_reference_markdown

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config-reference.md"


def test_config_reference_is_current():
    """A field added, renamed or re-documented in titanrl/config/schema.py changes the generated
    page; the committed one must be regenerated with it."""
    assert PAGE.read_text() == config_reference_markdown(), (
        f"{PAGE} is stale: regenerate it with `{COMMAND}` (from the repository root) and commit it"
    )


def test_config_reference_lists_every_field():
    """Every settable field of every section appears once, under its command-line name."""
    import dataclasses

    from titanrl.config.overrides import IN_MEMORY_ROWS
    from titanrl.config.schema import RunConfig

    def leaves(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from leaves(value, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name, f.name

    page = config_reference_markdown()
    for key, name in leaves(RunConfig()):
        shown = f"- `{key}` (Python only" if name in IN_MEMORY_ROWS else f"- `--{key}` · "
        assert page.count(shown) == 1, key
    assert "(no docstring)" not in page
