"""`megarl-serve`: the rollout replicas of the CPU demo config, started on Ray, serving until SIGTERM."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cases.engine_cases import engine_client, run

from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import EngineError
from megarl.engines.client.sampling import SamplingParams


def test_serve_starts_the_demo_replicas_and_stops_them_on_sigterm(tmp_path: Path, data_overrides: list[str]) -> None:
    exe = Path(sys.executable).with_name("megarl-serve")
    command = [
        str(exe),
        "--config-name",
        "demo_cpu",
        "model=tiny_dense",
        *data_overrides,
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving"):
                break
        urls = [m.group(1) for line in lines if (m := re.match(r"replica \d+: (\S+) \(\d+ tokens", line))]
        assert len(urls) == 2, "".join(lines)
        assert sum("(16 tokens in" in line for line in lines) == 2, "".join(lines)
        key_file = tmp_path / "run" / "engine_keys.json"
        assert f"bearer keys in {key_file}\n" in lines and key_file.stat().st_mode & 0o777 == 0o600
        stored = json.loads(key_file.read_text())
        keys = EngineKeys(api=stored["api_key"], admin=stored["admin_api_key"])
        assert not [line for line in lines for key in keys.values() if key in line]

        async def generate() -> int:
            anonymous, client = engine_client(urls[1]), engine_client(urls[1], keys)
            with pytest.raises(EngineError, match="HTTP 401"):
                await anonymous.generate([5, 6], SamplingParams(max_new_tokens=3))
            await anonymous.close()
            (result,) = await client.generate([5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
            await client.close()
            return len(result.output_ids)

        assert run(generate()) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()

    async def healthy() -> bool:
        client = engine_client(urls[0])
        try:
            return await client.health(timeout_s=2.0)
        finally:
            await client.close()

    assert not run(healthy())
    assert (tmp_path / "run" / "engine_logs" / "replica1" / "node0.log").exists()
