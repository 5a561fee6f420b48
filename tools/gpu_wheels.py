"""Fill `.whl/` with exactly the wheels the GPU check machine lacks to run megarl (cp312, manylinux x86-64).

That machine has no network; its image already holds torch 2.11, transformers 5.17 and ~200 other packages
(`tools/gpu_device_site.txt`). This resolves megarl's requirements for it with pip (pinned to the versions the
image is known to hold), walks the dependency graph from megarl's own requirements and stops at every package
the image holds, and downloads the rest. Ray's wheel is repacked without what megarl never imports (Java jars,
RLlib, Serve, Data, Train, Tune, LLM, Workflow and the dashboard's web client). `antlr4-python3-runtime` 4.9.3
(hydra's parser runtime) has no wheel on the index and is built here.

It writes `.whl/*.whl`, `.whl/provided.txt` (the image's packages megarl uses, at the resolved versions: what
`device_check.sh --dry` installs to stand in for the image) and prints the bytes that travel with the working
tree; it fails above the 64 MiB budget.

    bash tools/gpu_wheels.sh
"""

import ast
import json
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".whl"
SITE = ROOT / "tools" / "gpu_device_site.txt"
BUDGET_BYTES = 64 * 2**20
PYTHON = "3.12"
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]
LEFT_OUT = {
    "wandb": "imported only with trainer.logger containing wandb; its wheel alone is over 20 MB",
}
"""megarl requirements the check does not carry, and why."""
RAY_DROPPED = ("jars", "rllib", "serve", "data", "train", "tune", "llm", "workflow", "dashboard/client")
"""Top-level folders of the `ray` package that megarl never imports (`ray/<folder>/…`)."""


def core_requirements() -> list[str]:
    """`CORE` of setup.py, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CORE":
            return list(ast.literal_eval(node.value))
    raise SystemExit("gpu_wheels: setup.py has no CORE list")


def device_requirements(core: list[str]) -> list[Requirement]:
    """megarl's requirements as the check runs them: Ray without its dashboard extras, minus `LEFT_OUT`."""
    reqs = [Requirement(line) for line in core]
    for req in reqs:
        req.extras = set()
    return [req for req in reqs if canonicalize_name(req.name) not in LEFT_OUT]


def device_site() -> tuple[set[str], list[str]]:
    """(names the image holds, `name==version` pins of those whose version is known)."""
    lines = [line.strip() for line in SITE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return {canonicalize_name(line.split("==")[0]) for line in lines}, [line for line in lines if "==" in line]


def platform_args() -> list[str]:
    glibc = [f"manylinux_2_{minor}_x86_64" for minor in range(5, 40)]
    tags = [*glibc, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    args = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    return args + [arg for tag in tags for arg in ("--platform", tag)]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build_sdists() -> None:
    for spec in SDIST_ONLY:
        name = canonicalize_name(spec.split("==")[0]).replace("-", "_")
        if not list(OUT.glob(f"{name}-*.whl")):
            pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(OUT), spec)


def resolve(reqs: list[Requirement], pins: list[str]) -> dict[str, dict]:
    """Canonical name → pip's report entry for everything `reqs` need on the machine, `pins` held."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints, report = Path(tmp) / "pins.txt", Path(tmp) / "report.json"
        constraints.write_text("\n".join(pins) + "\n")
        pip(
            "install", "--quiet", "--dry-run", "--ignore-installed", "--target", str(Path(tmp) / "site"),
            "--report", str(report), "--find-links", str(OUT), "-c", str(constraints),
            *platform_args(), *(str(req) for req in reqs),
        )  # fmt: skip
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in items}


def _dependencies(metadata: dict, environment: dict[str, str]) -> list[str]:
    out = []
    for line in metadata.get("requires_dist", []):
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**environment, "extra": ""}):
            out.append(canonicalize_name(req.name))
    return out


def split(roots: list[Requirement], resolved: dict[str, dict], held: set[str]) -> tuple[list[str], list[str]]:
    """(`name==version` to carry, `name==version` the image provides): the graph from `roots`, not entering
    the dependencies of a package the image holds (it holds what that package needs)."""
    environment = default_environment() | {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3"}
    environment |= {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    queue, seen = deque(canonicalize_name(req.name) for req in roots), set()
    carry, provided = [], []
    while queue:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        pinned = f"{name}=={resolved[name]['version']}"
        if name in held:
            provided.append(pinned)
            continue
        carry.append(pinned)
        queue.extend(_dependencies(resolved[name], environment))
    return sorted(carry), sorted(provided)


def download(carry: list[str]) -> None:
    built = {canonicalize_name(spec.split("==")[0]) for spec in SDIST_ONLY}
    wanted = [spec for spec in carry if canonicalize_name(spec.split("==")[0]) not in built]
    pip("download", "--quiet", "--no-deps", "--dest", str(OUT), *platform_args(), *wanted)


def repack_ray() -> None:
    """Rewrite Ray's wheel without `RAY_DROPPED` (and their RECORD lines); a no-op once done."""
    (wheel,) = OUT.glob("ray-*.whl")
    dropped = tuple(f"ray/{folder}/" for folder in RAY_DROPPED)
    with zipfile.ZipFile(wheel) as source:
        if not any(info.filename.startswith(dropped) for info in source.infolist()):
            return
        kept = [info for info in source.infolist() if not info.filename.startswith(dropped)]
        repacked = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(repacked, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
            for info in kept:
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if not line.startswith(dropped)).encode()
                target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    repacked.replace(wheel)


def prune(carry: list[str]) -> None:
    """Remove wheels of earlier runs that the current set no longer needs (one version of each)."""
    wanted = {(canonicalize_name(spec.split("==")[0]), spec.split("==")[1]) for spec in carry}
    for wheel in OUT.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        if (canonicalize_name(name), version) not in wanted:
            wheel.unlink()


def tree_bytes() -> int:
    """Bytes of the files that travel besides `.whl/`: tracked, and untracked but not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def main() -> None:
    OUT.mkdir(exist_ok=True)
    build_sdists()
    held, pins = device_site()
    roots = device_requirements(core_requirements())
    carry, provided = split(roots, resolve(roots, pins), held)
    download(carry)
    repack_ray()
    prune(carry)
    (OUT / "provided.txt").write_text("\n".join(provided) + "\n")
    wheels = sum(path.stat().st_size for path in OUT.iterdir())
    tree = tree_bytes()
    for name, why in LEFT_OUT.items():
        print(f"gpu_wheels: not carried: {name} ({why})")
    print(f"gpu_wheels: {len(carry)} wheels: {', '.join(carry)}")
    print(f"gpu_wheels: the image provides: {', '.join(provided)}")
    print(
        f"gpu_wheels: .whl/ {wheels} bytes + working tree {tree} bytes = {wheels + tree} bytes "
        f"({(wheels + tree) / 2**20:.1f} MiB of the {BUDGET_BYTES // 2**20} MiB budget)"
    )
    if wheels + tree > BUDGET_BYTES:
        raise SystemExit("gpu_wheels: over the budget: carry less (LEFT_OUT, RAY_DROPPED) or shrink the tree")


if __name__ == "__main__":
    main()
