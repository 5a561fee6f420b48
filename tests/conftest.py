"""Shared fixtures (the repo's GSM8K files, small preprocessed parquet files, config composition) and the
tiers: each test is marked with the folder it lives in (`unit`, `dist`, `e2e`, `gpu`), so `pytest -m unit`
runs the in-process tests alone. tests/README.md says what each tier holds."""

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_module

from megarl.config import MegarlConfig, register_configs, to_config
from megarl.data import gsm8k

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
TIERS = ("unit", "dist", "e2e", "gpu")
SLOWEST_FILES = (
    "e2e/test_trainer_e2e.py",
    "e2e/test_async_training.py",
    "e2e/test_fault_tolerance.py",
    "dist/test_trainer_checkpoint.py",
    "e2e/test_vision_e2e.py",
    "e2e/test_packaging.py",
    "e2e/test_device_check.py",
    "e2e/test_separate_pools.py",
)
"""Files of several minutes each on 2 cores (CI's slowest durations), run first so that with pytest-xdist
(`tests/run.sh`: two files at a time) the short files fill in around them instead of one long file running
alone at the end. Then e2e, dist, unit and gpu files, each tier in name order."""
TIER_ORDER = ("e2e", "dist", "unit", "gpu")
GSM8K_DIR = REPO / "data" / "gsm8k"


def compose_config(*overrides: str, config_name: str = "ppo") -> MegarlConfig:
    """Compose a config exactly as `megarl-train` does, with command-line style overrides."""
    register_configs()
    with initialize_config_module(config_module="megarl.configs", version_base=None):
        return to_config(compose(config_name=config_name, overrides=list(overrides)))


@pytest.fixture(scope="session")
def small_parquet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """40 GSM8K test rows as parquet, without and with tools."""
    root = tmp_path_factory.mktemp("gsm8k")
    jsonl = root / "small.jsonl"
    with (GSM8K_DIR / "test.jsonl").open() as f:
        jsonl.write_text("".join(next(f) for _ in range(40)))
    files = {"plain": root / "plain.parquet", "tools": root / "tools.parquet"}
    gsm8k.preprocess(jsonl, files["plain"], "test", with_tools=False)
    gsm8k.preprocess(jsonl, files["tools"], "test", with_tools=True)
    return files


@pytest.fixture(scope="session")
def data_overrides(small_parquet: dict[str, Path]) -> list[str]:
    """Overrides pointing data.* at the small parquet file."""
    path = json.dumps(str(small_parquet["plain"]))
    return [f"data.train_files=[{path}]", f"data.val_files=[{path}]"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A private single-node Ray cluster (short temp dir: Ray's socket paths have a length limit)."""
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as temp_dir:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, the first folder under tests/ (a test outside the tiers is an error), and
    order the files slowest first (`SLOWEST_FILES`); a file's tests keep their order."""
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.path}: tests live under tests/{{{','.join(TIERS)}}}/, not in {tier}")
        item.add_marker(tier)
    items.sort(key=_file_rank)


def _file_rank(item: pytest.Item) -> tuple[int, int, str]:
    path = item.path.relative_to(TESTS)
    slow = SLOWEST_FILES.index(path.as_posix()) if path.as_posix() in SLOWEST_FILES else len(SLOWEST_FILES)
    return slow, TIER_ORDER.index(path.parts[0]), path.as_posix()
