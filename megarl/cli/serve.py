"""`megarl-serve [overrides]`: start the rollout replicas of a training config and keep them serving.

For trying an engine setup (SGLang flags, multi-node replicas, memory) before training, and for
driving engines by hand. It validates the config, starts every replica on Ray (`RAY_ADDRESS`, or
a private local cluster), prints each replica's URL, checks each with one greedy generation, and
serves until Ctrl-C or SIGTERM, then stops every server. Engine logs go to
`<trainer.run_dir>/engine_logs/`. The servers take a fresh pair of bearer keys (`megarl.engines.client.auth`),
written to `<trainer.run_dir>/engine_keys.json` (readable by its owner only): `api_key` for /generate,
`admin_api_key` for the control endpoints, e.g. `curl -H "Authorization: Bearer <api_key>" ...`.
"""

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from megarl.cli import refuse_moved_keys, typed_config
from megarl.config import MegarlConfig, register_configs
from megarl.engines.client.auth import EngineKeys
from megarl.plan.facts import rollout_devices

register_configs()


def main() -> None:
    """`megarl-serve [overrides]`: moved keys are refused with their new names, then Hydra composes the config."""
    refuse_moved_keys(sys.argv[1:], "megarl-serve")
    _main()


@hydra.main(version_base=None, config_path="pkg://megarl.configs", config_name="ppo")
def _main(cfg: DictConfig) -> None:
    config = typed_config(cfg, "megarl-serve")
    serve(config)


def serve(cfg: MegarlConfig) -> None:
    """Launch, report, serve until a signal, stop."""
    import ray

    from megarl.engines.replicas.launch import launch_engines

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    launched = launch_engines(
        cfg.rollout,
        cfg.model,
        num_devices=rollout_devices(cfg),
        devices_per_node=cfg.trainer.devices_per_node,
        device=cfg.trainer.device,
        log_dir=Path(cfg.trainer.run_dir) / "engine_logs",
        keys=EngineKeys.generate(),
        multi_node=cfg.trainer.nnodes > 1,
    )
    try:
        for line in asyncio.run(_check(launched.urls, launched.keys)):
            print(line, flush=True)
        print(f"bearer keys in {launched.keys.write(Path(cfg.trainer.run_dir) / 'engine_keys.json')}", flush=True)
        print(f"serving {len(launched.urls)} {cfg.rollout.engine} replicas; Ctrl-C or SIGTERM stops them", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    finally:
        launched.stop()
        ray.shutdown()


async def _check(urls: list[str], keys: EngineKeys) -> list[str]:
    from megarl.engines.client.fleet import Fleet
    from megarl.engines.client.sampling import SamplingParams

    lines = []
    for index, client in enumerate(Fleet.connect(urls, keys).clients):
        start = time.perf_counter()
        (result,) = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
        await client.close()
        seconds = time.perf_counter() - start
        lines.append(f"replica {index}: {client.url} ({len(result.output_ids)} tokens in {seconds:.2f} s)")
    return lines


if __name__ == "__main__":
    main()
