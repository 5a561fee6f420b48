"""Stands in for megarl-train under tests/e2e/test_slurm.py: reports what the driver sees, then waits.

Writes {"alive_nodes", "node_ips", "argv", "ray_address"} as JSON to $PROBE_OUT, then sleeps
$PROBE_SLEEP seconds (to be cancelled) before exiting with $PROBE_EXIT.
"""

import json
import os
import sys
import time
from pathlib import Path

import ray

ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", include_dashboard=False)
alive = [node for node in ray.nodes() if node["Alive"]]
report = {
    "alive_nodes": len(alive),
    "node_ips": sorted(node["NodeManagerAddress"] for node in alive),
    "argv": sys.argv[1:],
    "ray_address": os.environ["RAY_ADDRESS"],
}
ray.shutdown()
Path(os.environ["PROBE_OUT"]).write_text(json.dumps(report))
time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
