"""No code outside `titanrl/models/` names a model family's parameters: generic code asks the spec.

The scan reads every module's syntax tree and looks at code only (string literals that are not
docstrings, and attribute names), so prose in comments and docstrings may still describe names.
"""

import ast
import functools
from pathlib import Path

import pytest

import titanrl
from titanrl.models.architectures import SPECS
from titanrl.models.tiny import tiny_config

PACKAGE = Path(titanrl.__file__).parent

MOE_PENDING: set[str] = set()
"""Files allowed to name expert parameters while they move behind the spec: none left."""


@functools.cache
def family_names() -> frozenset[str]:
    """Every module-path component of every registered family's parameters that is specific to
    the families (not generic words such as 'weight', 'bias', 'model', 'layers', digits)."""
    import torch

    names: set[str] = set()
    for spec in SPECS.values():
        base = tiny_config()
        fields = {f: getattr(base, f) for f in ("vocab_size", "hidden_size", "intermediate_size",
                                                 "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim")}
        with torch.device("meta"):
            model = spec.model_class(spec.config_class(**fields))
        for full in model.state_dict():  # a tied head included
            names.update(part for part in full.split(".") if not part.isdigit())
    return frozenset(names - {"weight", "bias", "model", "layers", "norm", "gate"})


def code_mentions(path: Path, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, name) for each family name used in code: as an attribute or inside a non-docstring
    string literal as a dotted component."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:  # module/class/function docstrings and attribute docstrings
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                    docstrings.add(id(stmt.value))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            hits.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            parts = set(node.value.replace(":", ".").split("."))
            if "." in node.value or node.value in names:
                hits.extend((node.lineno, n) for n in sorted(parts & names))
    return hits


def test_the_family_name_set_is_the_models_own():
    """The scan looks for real names: each dense family's projections and norms are in the set."""
    names = family_names()
    assert {"q_proj", "o_proj", "down_proj", "embed_tokens", "lm_head", "self_attn", "mlp",
            "input_layernorm", "q_norm", "experts"} <= names


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if "models" not in p.relative_to(PACKAGE).parts[:1]),
                         ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_parameter_name_outside_models(path):
    """This module names no family parameter in code (MoE files on the pending list excepted)."""
    rel = str(path.relative_to(PACKAGE.parent))
    hits = code_mentions(path, family_names())
    if rel in MOE_PENDING:
        assert hits, f"{rel} no longer names family parameters: remove it from MOE_PENDING"
        assert {n for _, n in hits} <= {"experts", "expert_bias", "mlp"}, hits
        return
    assert not hits, f"{rel} names family parameters in code: {hits}; ask the model's spec instead"
