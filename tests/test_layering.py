"""The package boundaries hold: engines and sync never reach into agents, and the rollout side never
imports Megatron or the trainer. Every import is checked, module level and inside functions."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"

# (package whose modules are checked, module prefixes they must not import, why)
RULES = [
    ("engines", ("megarl.agents",), "engines serve tokens; agents drive them, never the other way"),
    ("sync", ("megarl.agents",), "weight sync reaches engines only"),
    ("engines", ("megatron", "megarl.megatron", "megarl.workers", "megarl.trainer", "megarl.sync"), "no trainer"),
    ("agents", ("megatron", "megarl.megatron", "megarl.workers", "megarl.trainer", "megarl.sync"), "no trainer"),
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


AGENTS_SEE_OF_ENGINES = ("client", "protocol", "sampling", "auth", "router")
"""The client side of `megarl.engines` (a replica's API, its wire types, keys, the router over clients): what
agents may import. Launch, the fleet's control calls, embedded engines and weight transport are the trainer's."""


def test_agents_import_only_the_client_side_of_engines() -> None:
    allowed = tuple(f"megarl.engines.{name}" for name in AGENTS_SEE_OF_ENGINES)
    found = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / "agents").rglob("*.py"))
        for name in sorted(imported_modules(path.read_text()))
        if name.startswith("megarl.engines") and not any(name == a or name.startswith(a + ".") for a in allowed)
    ]
    assert found == []


def test_engine_clients_are_built_only_by_the_fleet() -> None:
    """`EngineClient(...)` is called in `engines/fleet.py` only: every process reuses its fleet's clients."""
    calls = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "EngineClient"
    ]
    assert [call.split(":")[0] for call in calls] == ["megarl/engines/fleet.py"], calls
