"""The layout's size rules (docs/design.md, "Where things live"): parts small enough to read.

No class over 300 lines, no module outside ``bench/`` over 450, no function
over 60 (the exceptions are named here with their reason), and the
dispatcher's constructor only wires its parts together.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuq"
# function -> why it is longer than 60 lines
LONG_FUNCTIONS: dict[str, str] = {}


def _defs():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                yield rel, node, node.end_lineno - node.lineno + 1


def test_no_module_outside_bench_is_over_450_lines():
    big = {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 450}
    assert not {p: n for p, n in big.items() if not p.startswith("bench/")}


def test_no_class_is_over_300_lines():
    assert not [(rel, node.name, n) for rel, node, n in _defs() if isinstance(node, ast.ClassDef) and n > 300]


def test_no_function_is_over_60_lines_but_the_named_exceptions():
    long = {f"{rel}:{node.name}" for rel, node, n in _defs() if not isinstance(node, ast.ClassDef) and n > 60}
    assert long == set(LONG_FUNCTIONS)


def test_the_dispatcher_constructor_only_wires_its_parts():
    [init] = [node for rel, node, _n in _defs() if rel == "dispatcher/loop.py" and node.name == "__init__"]
    assert init.end_lineno is not None and init.end_lineno - init.lineno + 1 <= 20
