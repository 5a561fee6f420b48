"""The package boundaries hold: every package imports only packages of lower layers (so no two packages
import each other and no arrow points up), no module takes part in an import circle, engines and sync never
reach into agents, agents reach engines only through `engines.client`, which imports no other part of engines,
the rollout side never imports Megatron or the trainer, config holds schemas only, and only the CLI runs the
gate. Every import is checked, module level and inside functions."""

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"

BEHAVIOUR = (
    "megarl.agents",
    "megarl.algo",
    "megarl.convert",
    "megarl.cli",
    "megarl.data",
    "megarl.engines",
    "megarl.megatron",
    "megarl.models",
    "megarl.plan",
    "megarl.rewards",
    "megarl.scoring",
    "megarl.sync",
    "megarl.trainer",
    "megarl.workers",
    "megatron",
)
GATE = "megarl.plan.gate"

# megarl's packages from the bottom up: a package imports only packages of lower layers
LAYERS = [
    ("batch", "plugins", "quiet", "assets", "ports"),  # the data structure, the plug-in loader, free ports
    ("config",),  # schemas and each group's own checks
    ("algo", "models", "rewards"),  # pure torch; HF model facts and weight plans; rule scores
    ("data",),
    ("engines", "megatron"),  # serving rollouts; training on megatron-core
    ("lora", "scoring"),  # adapters on megatron's layers and their PEFT form; model rewards as trajectories end
    ("convert", "sync", "agents", "plan"),  # checkpoint conversion; weight sync; agent loops; the job's facts
    ("workers",),
    ("trainer",),
    ("cli",),
]
LAYER = {package: i for i, names in enumerate(LAYERS) for package in names}

# (package whose modules are checked, module prefixes they must not import, why)
RULES = [
    ("engines", ("megarl.agents",), "engines serve tokens; agents drive them, never the other way"),
    ("sync", ("megarl.agents",), "weight sync reaches engines only"),
    ("engines", ("megatron", "megarl.megatron", "megarl.workers", "megarl.trainer", "megarl.sync"), "no trainer"),
    ("agents", ("megatron", "megarl.megatron", "megarl.workers", "megarl.trainer", "megarl.sync"), "no trainer"),
    ("config", BEHAVIOUR, "config holds schemas and each group's own checks; the gate and derived facts are in plan"),
    (
        "engines/client",
        ("megarl.engines.replicas", "megarl.engines.weights", "megarl.engines.embedded"),
        "the client reaches running engines over HTTP: it starts none, moves no weights, serves nothing",
    ),
    ("engines/weights", ("megarl.engines.replicas", "megarl.engines.embedded"), "weight transport needs the API only"),
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


def modules() -> Iterator[tuple[str, Path]]:
    """Every megarl module's dotted name and file, but `megarl/__init__.py`."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts != ("megarl", "__init__"):
            yield ".".join(parts).removesuffix(".__init__"), path


def package_of(module: str) -> str:
    """`megarl.<package>...` -> package (a top-level module is its own package)."""
    return module.split(".")[1]


def upward_arrows() -> list[str]:
    """Imports from a package into one of the same or a higher layer, one line per module and package."""
    found = []
    for module, path in modules():
        me = package_of(module)
        names = imported_modules(path.read_text())
        for other in sorted({package_of(n) for n in names if n.startswith("megarl.")} - {me}):
            if LAYER[other] >= LAYER[me]:
                found.append(f"{module} (layer {LAYER[me]}) imports megarl.{other} (layer {LAYER[other]})")
    return found


def module_circles() -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan's algorithm)."""
    files = dict(modules())
    graph = {m: {n for n in imported_modules(p.read_text()) if n in files} - {m} for m, p in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            circles.extend([sorted(group)] if len(group) > 1 else [])

    for v in graph:
        if v not in index:
            visit(v)
    return circles


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
    assert "megarl.engines.client.sglang_api" in imported_modules(
        (PACKAGE / "engines" / "client" / "client.py").read_text()
    )


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module) for module, _ in modules()}
    assert packages == set(LAYER)


def test_no_upward_arrows() -> None:
    assert upward_arrows() == []


def test_no_module_circles() -> None:
    assert module_circles() == []


def test_the_walkers_see_an_arrow_up_and_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a made-up tree: config importing the trainer points up, and two modules importing each other
    (one of them lazily) make a circle."""
    for name, source in {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/root.py": "def f():\n    from megarl.trainer.a import x\n",
        "trainer/__init__.py": "",
        "trainer/a.py": "from megarl.trainer.b import y\nx = 1\n",
        "trainer/b.py": "def g():\n    from megarl.trainer import a\ny = 2\n",
    }.items():
        (tmp_path / "megarl" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "megarl" / name).write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "megarl")
    assert upward_arrows() == ["megarl.config.root (layer 1) imports megarl.trainer (layer 8)"]
    assert module_circles() == [["megarl.trainer.a", "megarl.trainer.b"]]


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


def test_agents_import_only_the_client_of_engines() -> None:
    """Agents import from `megarl.engines` only its `client` subpackage (a replica's API, its wire types, keys, the
    router over clients). Launch, embedded engines and weight transport are the trainer's."""
    allowed = "megarl.engines.client"
    found = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / "agents").rglob("*.py"))
        for name in sorted(imported_modules(path.read_text()))
        if name.startswith("megarl.engines") and not (name == allowed or name.startswith(allowed + "."))
    ]
    assert found == []


def test_engine_clients_are_built_only_by_the_fleet() -> None:
    """`EngineClient(...)` is called in `engines/client/fleet.py` only: every process reuses its fleet's clients."""
    calls = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "EngineClient"
    ]
    assert [call.split(":")[0] for call in calls] == ["megarl/engines/client/fleet.py"], calls


def test_rank_workers_never_see_the_whole_config() -> None:
    """The role workers (and what every rank runs, `workers/base.py`) get their role's settings
    (`workers/settings.py`, built on the driver), never `MegarlConfig` nor the driver's facts about it."""
    ranks = ("actor.py", "critic.py", "reference.py", "base.py")
    found = [
        f"workers/{name} imports {module}"
        for name in ranks
        for module in sorted(imported_modules((PACKAGE / "workers" / name).read_text()))
        if module in ("megarl.config", "megarl.config.root") or module.startswith("megarl.plan")
    ]
    assert found == []
