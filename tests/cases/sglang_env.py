"""The SGLang contract environment: the pinned sglang wheel and the few pure packages its CPU-importable
modules need, installed without dependencies into a cache directory outside the clone (once per pin
set), and a runner for `sglang_side.py` commands in it.

Which packages: importing `sglang.srt.utils.common`, `server_args`, `utils.patch_torch` and
`weight_sync.tensor_bucket` with megarl's CPU torch needs exactly these (the versions are those pip
resolves for `.[gpu]`). `managers/io_struct.py` and `weight_updater.py` also want torchvision, whose
PyPI build fails against the CPU torch, so the tests read those two files' text instead.
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PINS = (
    "sglang==0.5.23",
    "orjson==3.13.0",
    "pybase64==1.5.1",
    "triton==3.8.0",
    "starlette==1.10.0",
    "msgspec==0.22.0",
    "pyzmq==27.3.0",
    "ipython==9.18.1",
    "traitlets==5.16.1",
)
SIDE = Path(__file__).with_name("sglang_side.py")


def cache_root() -> Path:
    return Path(os.environ.get("MEGARL_CACHE_DIR", Path.home() / ".cache" / "megarl"))


def sglang_site() -> Path:
    """The directory holding the pinned wheels (installed on first use; later calls only look)."""
    key = hashlib.sha256(json.dumps([PINS, sys.version_info[:2], sys.platform]).encode()).hexdigest()[:12]
    site = cache_root() / f"sglang-contract-{key}"
    if (site / "sglang").is_dir():
        return site
    site.parent.mkdir(parents=True, exist_ok=True)
    with open(site.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (site / "sglang").is_dir():
            staging = site.with_suffix(".partial")
            shutil.rmtree(staging, ignore_errors=True)
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
            subprocess.run([*command, "--target", str(staging), *PINS], check=True, timeout=900)
            staging.rename(site)
    return site


def sglang_file(site: Path, relative: str) -> Path:
    """A source file of the installed sglang package, e.g. `srt/managers/io_struct.py`."""
    return site / "sglang" / relative


def run_side(site: Path, command: str, request: dict[str, Any], timeout_s: float = 180.0) -> Any:
    """Run one `sglang_side.py` command to completion; its JSON answer."""
    done = subprocess.run(
        [sys.executable, str(SIDE), str(site), command],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"sglang_side {command} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_side(site: Path, command: str, request: dict[str, Any]) -> subprocess.Popen[str]:
    """Start one `sglang_side.py` command in the background (the request is already written to it)."""
    process = subprocess.Popen(
        [sys.executable, str(SIDE), str(site), command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps(request))
    process.stdin.close()
    process.stdin = None  # written and closed: communicate() must not flush it
    return process


def finish_side(process: subprocess.Popen[str], timeout_s: float) -> Any:
    """Wait for a started command (killing it after `timeout_s`); its JSON answer."""
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        raise RuntimeError(f"sglang_side did not finish in {timeout_s} s:\n{stderr[-4000:]}") from None
    if process.returncode != 0:
        raise RuntimeError(f"sglang_side exited {process.returncode}:\n{stderr[-4000:]}")
    return json.loads(stdout.strip().splitlines()[-1])
