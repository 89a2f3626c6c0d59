"""The suite runs on busy 2-core CI machines: a test waits on a condition with a generous
deadline, never sleeps a fixed short time and then asserts that something has happened."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MIN_DEADLINE_S = 10.0  # what "generous" means for a wait on a busy machine
DEADLINE_KEYWORDS = ("within", "deadline", "timeout_s")


def _is_sleep(node: ast.stmt) -> bool:
    value = node.value if isinstance(node, ast.Expr) else None
    if isinstance(value, ast.Await):
        value = value.value
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == "sleep"


def _blocks(tree: ast.AST):
    for node in ast.walk(tree):
        for attr in ("body", "orelse", "finalbody"):
            block = getattr(node, attr, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def sleep_then_assert(path: Path) -> list[str]:
    """`sleep(...)` directly followed by `assert` in the same block: a race with the server."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for block in _blocks(tree):
        for first, second in zip(block, block[1:]):
            if _is_sleep(first) and isinstance(second, ast.Assert):
                found.append(f"{path.relative_to(TESTS)}:{first.lineno}")
    return found


def short_deadlines(path: Path) -> list[str]:
    """Wait deadlines shorter than 10 s: `within=`-style arguments, their defaults, and
    `time.monotonic() + N`."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if _short_monotonic_deadline(node):
            found.append(f"{path.relative_to(TESTS)}:{node.lineno} monotonic() + short")  # type: ignore[attr-defined]
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                value = kw.value
                if (
                    kw.arg in DEADLINE_KEYWORDS
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, (int, float))
                    and value.value < MIN_DEADLINE_S
                ):
                    found.append(f"{path.relative_to(TESTS)}:{node.lineno} {kw.arg}={value.value}")
        if isinstance(node, ast.FunctionDef):
            names = [a.arg for a in node.args.args]
            defaults = node.args.defaults
            for name, default in zip(names[len(names) - len(defaults) :], defaults):
                if (
                    name in DEADLINE_KEYWORDS
                    and isinstance(default, ast.Constant)
                    and isinstance(default.value, (int, float))
                    and default.value < MIN_DEADLINE_S
                ):
                    found.append(f"{path.relative_to(TESTS)}:{node.lineno} def {node.name}")
    return found


def _short_monotonic_deadline(node: ast.AST) -> bool:
    """`time.monotonic() + 2.0`: a hand-rolled deadline that is too short."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
        return False
    call, const = node.left, node.right
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in ("monotonic", "time", "perf_counter")
        and isinstance(const, ast.Constant)
        and isinstance(const.value, (int, float))
        and const.value < MIN_DEADLINE_S
    )


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


def test_no_fixed_sleep_followed_by_an_assertion() -> None:
    found = [hit for p in _test_files() for hit in sleep_then_assert(p)]
    assert not found, f"wait on a condition with a deadline instead: {found}"


def test_waits_have_generous_deadlines() -> None:
    found = [hit for p in _test_files() for hit in short_deadlines(p)]
    assert not found, f"deadlines under {MIN_DEADLINE_S} s flake on a busy machine: {found}"
