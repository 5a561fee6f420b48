"""`megarl-train` as a subprocess, for the tests of its command line."""

import subprocess
import sys
from pathlib import Path

from conftest import REPO


def megarl_train(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("megarl-train")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=REPO, timeout=120)
