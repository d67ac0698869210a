"""References serve the tests: every fast op has a plain reference beside it with the same
signature (`*_reference`, and the modules naive.py and reference.py), and nothing the engine runs
calls one. Production falls back on torch forms named for what they are, so speeding one up never
moves the oracle the tests compare against."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pocketllm

PACKAGE = Path(pocketllm.__file__).parent
TESTS = Path(__file__).parent
REFERENCE_MODULES = {"naive", "reference"}
REFERENCE_NAME = re.compile(r"\w_reference_?$")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE), ast.parse(path.read_text())


def _references_used(tree: ast.AST) -> list[str]:
    """What a module imports or names of the references: a reference module, or a `*_reference`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.rpartition(".")[2] in REFERENCE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.rpartition(".")[2] in REFERENCE_MODULES:
                found.append(f"from {module} import ...")
            found += [f"from {module} import {a.name}" for a in node.names if a.name in REFERENCE_MODULES or REFERENCE_NAME.search(a.name)]
        elif isinstance(node, ast.Name) and REFERENCE_NAME.search(node.id):
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and REFERENCE_NAME.search(node.attr):
            found.append(ast.unparse(node))
    return found


def test_no_production_module_imports_or_calls_a_reference():
    bad = []
    for rel, tree in _modules():
        if rel.stem in REFERENCE_MODULES:
            continue
        bad += [f"{rel}: {use}" for use in _references_used(tree)]
    assert not bad, "production code uses a reference (name the torch form it runs instead):\n" + "\n".join(bad)


def test_every_reference_is_held_to_something_by_a_test():
    defined = {
        (rel, node.name)
        for rel, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and (REFERENCE_NAME.search(node.name) or rel.stem in REFERENCE_MODULES)
    }
    assert defined
    tests = "\n".join(p.read_text() for p in TESTS.rglob("*.py"))
    unused = sorted(f"{rel}: {name}" for rel, name in defined if not re.search(rf"\b{name}\b", tests))
    assert not unused, "references no test uses:\n" + "\n".join(unused)


def test_the_scan_sees_a_reference_wherever_it_is_named():
    source = """
from pocketllm.ops.gated_delta import naive
from pocketllm.ops.fused.reference import silu_mul_reference
from pocketllm.ops.fused import reference
import pocketllm.ops.gated_delta.naive
y = layout.quant_linear_reference(x, w, out)
z = gated_delta_step_reference_(q, k, v, g, beta, s)
"""
    uses = _references_used(ast.parse(source))
    assert len(uses) == 7, uses
    assert _references_used(ast.parse("from pocketllm.ops.rowwise import silu_mul_torch\nreferenced = 1\n")) == []
