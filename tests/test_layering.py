"""The package boundaries hold: engines and sync never reach into agents, the rollout side never
imports Megatron or the trainer, config holds schemas only, and only the CLI runs the gate.
Every import is checked, module level and inside functions."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"

BEHAVIOUR = (
    "megarl.agents",
    "megarl.algo",
    "megarl.checkpoint",
    "megarl.cli",
    "megarl.data",
    "megarl.engines",
    "megarl.megatron",
    "megarl.models",
    "megarl.plan",
    "megarl.rewards",
    "megarl.sync",
    "megarl.trainer",
    "megarl.workers",
    "megatron",
)
GATE = "megarl.plan.gate"

# (package whose modules are checked, module prefixes they must not import, why)
RULES = [
    ("engines", ("megarl.agents",), "engines serve tokens; agents drive them, never the other way"),
    ("sync", ("megarl.agents",), "weight sync reaches engines only"),
    ("engines", ("megatron", "megarl.megatron", "megarl.workers", "megarl.trainer", "megarl.sync"), "no trainer"),
    ("agents", ("megatron", "megarl.megatron", "megarl.workers", "megarl.trainer", "megarl.sync"), "no trainer"),
    ("config", BEHAVIOUR, "config holds schemas and each group's own checks; the gate and derived facts are in plan"),
]


def imported_modules(source: str) -> set[str]:
    """Every absolute module an import statement in `source` names, wherever the statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in sorted(imported_modules(path.read_text())):
            if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return found


def test_import_walker_sees_lazy_and_from_imports() -> None:
    source = "import os\ndef f():\n    from megarl.agents.base import AgentLoop\n    import megatron.core\n"
    assert {"os", "megarl.agents.base", "megarl.agents.base.AgentLoop", "megatron.core"} <= imported_modules(source)
    assert "megarl.engines.protocol" in imported_modules((PACKAGE / "engines" / "client.py").read_text())


@pytest.mark.parametrize(("package", "forbidden", "why"), RULES)
def test_package_boundary(package: str, forbidden: tuple[str, ...], why: str) -> None:
    assert violations(package, forbidden) == [], why


def gate_imports(source: str) -> set[str]:
    """What `source` imports of the gate: `megarl.plan.gate`, or any module or name called `validate`."""
    return {name for name in imported_modules(source) if name.startswith(GATE) or "validate" in name.split(".")}


def test_only_the_cli_runs_the_gate() -> None:
    """Runtime facts come from `megarl.plan.facts`; the whole-config `validate` is imported by the CLI alone."""
    gate = PACKAGE / "plan" / "gate.py"
    outside = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != gate and not path.is_relative_to(PACKAGE / "cli")
        for name in sorted(gate_imports(path.read_text()))
    ]
    assert outside == []
    assert gate_imports((PACKAGE / "cli" / "__init__.py").read_text()) == {GATE, f"{GATE}.validate"}


def test_no_rollout_package_left() -> None:
    """The old `rollout` package (split into engines and agents) is gone, and nothing imports it."""
    assert not (PACKAGE / "rollout").exists()
    old = f"{PACKAGE.name}.rollout"
    stale = [
        str(path)
        for path in PACKAGE.rglob("*.py")
        if any(name.startswith(old) for name in imported_modules(path.read_text()))
    ]
    assert stale == []


def string_dispatches(source: str) -> list[int]:
    """Lines where a worker group's `broadcast` or `split_dp` names the worker method by a string."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("broadcast", "split_dp")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]


def test_no_worker_method_is_called_by_a_string() -> None:
    """Group calls name the method by its class attribute (`actor.split_dp(ActorWorker.update, ...)`), so mypy
    checks the arguments; a string would hide a misspelt method or a wrong argument until the run."""
    assert string_dispatches('actor.broadcast("to_rollout", "v7")\ng.split_dp(ActorWorker.update, b, 1)') == [1]
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in string_dispatches(path.read_text())
    ]
    assert found == []
