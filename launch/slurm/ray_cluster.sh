#!/usr/bin/env bash
# Ray on a slurm allocation: a head on the first node, a worker on every other node, one srun step
# each. Source it from a batch script, then:
#   ray_cluster_up        start the nodes and wait until all of them registered (exports RAY_ADDRESS)
#   ray_cluster_down      stop every node (SIGTERM to the steps; `ray start --block` cleans up)
# Knobs (environment; defaults in brackets):
#   MEGARL_LOG_DIR        per-node logs ray-<node>.log go here [logs/slurm-$SLURM_JOB_ID]
#   MEGARL_RAY_PORT       GCS port of the head [6379]
#   MEGARL_HEAD_IP        address the workers use to reach the head [first of `hostname --ip-address` on it]
#   MEGARL_RAY_WAIT_S     seconds to wait for all nodes to register [300]
#   MEGARL_RAY_STOP_S     seconds the nodes get to stop before SIGKILL [60]
#   MEGARL_RAY_NUM_CPUS / MEGARL_RAY_NUM_GPUS   resources each node offers [Ray detects them]
#   MEGARL_RAY_START_ARGS more `ray start` arguments for every node, e.g. "--object-store-memory=100000000000"
#   MEGARL_SRUN_ARGS      extra srun arguments for every node step, e.g. a container:
#                         "--container-image=/images/megarl.sqsh --container-mounts=/models:/models"
#   MEGARL_NODE_SETUP     shell run on each node before `ray start`, e.g. "source /opt/venv/bin/activate"
#   MEGARL_PYTHON         python with ray installed, on the batch host [python]
#   RAY_AUTH_MODE         Ray's token authentication: token (every node must read the same
#                         ~/.ray/auth_token, e.g. from a shared home) or disabled [disabled]
# NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA and the rest of the environment reach every
# node: srun exports the batch script's environment.

# Ray's GCS keeps the events of up to this many tasks (Ray's default 100000, ~3.3 KB each; a training step makes ~21
# calls, so the GCS would grow for thousands of steps: bench/soak.py); 10000 bounds its growth near 35 MB.
export RAY_task_events_max_num_task_in_gcs=${RAY_task_events_max_num_task_in_gcs:-10000}

RAY_CLUSTER_STEPS=()

ray_cluster_nodes() {
  scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a slurm allocation (SLURM_JOB_NODELIST is unset)}"
}

# _ray_node_step NODE ARGS...: `ray start ARGS --block` on NODE as a background srun step.
_ray_node_step() {
  local node=$1
  shift
  local -a extra=()
  if [ -n "${MEGARL_SRUN_ARGS:-}" ]; then
    read -r -a extra <<<"$MEGARL_SRUN_ARGS"
  fi
  [ -n "${MEGARL_RAY_NUM_CPUS:-}" ] && set -- "$@" --num-cpus="$MEGARL_RAY_NUM_CPUS"
  [ -n "${MEGARL_RAY_NUM_GPUS:-}" ] && set -- "$@" --num-gpus="$MEGARL_RAY_NUM_GPUS"
  if [ -n "${MEGARL_RAY_START_ARGS:-}" ]; then
    local -a start_args
    read -r -a start_args <<<"$MEGARL_RAY_START_ARGS"
    set -- "$@" "${start_args[@]}"
  fi
  srun --nodes=1 --ntasks=1 --overlap -w "$node" --output="$MEGARL_LOG_DIR/ray-$node.log" "${extra[@]}" \
    bash -c "${MEGARL_NODE_SETUP:-true} && exec ray start \"\$@\" --block" ray-node "$@" &
  RAY_CLUSTER_STEPS+=("$!")
}

# _ray_alive_nodes: how many nodes the cluster at $RAY_ADDRESS has alive (0 while the head is not up).
_ray_alive_nodes() {
  "${MEGARL_PYTHON:-python}" - "$RAY_ADDRESS" 2>/dev/null <<'PY' || echo 0
import sys

import ray

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False, include_dashboard=False)
print(sum(1 for node in ray.nodes() if node["Alive"]))
PY
}

# _ray_wait_nodes COUNT SECONDS: poll until COUNT nodes are alive; fails when SECONDS run out.
_ray_wait_nodes() {
  local deadline=$((SECONDS + $2))
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ "$(_ray_alive_nodes)" -ge "$1" ] && return 0
    sleep 2
  done
  return 1
}

ray_cluster_up() {
  local -a nodes
  mapfile -t nodes < <(ray_cluster_nodes)
  [ "${#nodes[@]}" -gt 0 ] || { echo "ray_cluster: no nodes in SLURM_JOB_NODELIST" >&2; return 1; }
  local head=${nodes[0]} port=${MEGARL_RAY_PORT:-6379} wait_s=${MEGARL_RAY_WAIT_S:-300}
  MEGARL_LOG_DIR=${MEGARL_LOG_DIR:-logs/slurm-${SLURM_JOB_ID:-local}}
  mkdir -p "$MEGARL_LOG_DIR"
  local head_ip=${MEGARL_HEAD_IP:-}
  if [ -z "$head_ip" ]; then
    head_ip=$(srun --nodes=1 --ntasks=1 --overlap -w "$head" hostname --ip-address | awk '{print $1}')
  fi
  export RAY_ADDRESS="$head_ip:$port"
  # Decided once for head, workers and driver: Ray 2.60 turns token auth on for a head that finds
  # ~/.ray/auth_token, and then every client needs the same token.
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
  echo "ray_cluster: head on $head ($RAY_ADDRESS), ${#nodes[@]} node(s): ${nodes[*]}; logs in $MEGARL_LOG_DIR"
  local start=$SECONDS
  _ray_node_step "$head" --head --node-ip-address="$head_ip" --port="$port" --include-dashboard=false
  _ray_wait_nodes 1 "$wait_s" || {
    echo "ray_cluster: the Ray head on $head did not come up within ${wait_s}s (MEGARL_RAY_WAIT_S);" \
      "see $MEGARL_LOG_DIR/ray-$head.log" >&2
    return 1
  }
  local node
  for node in "${nodes[@]:1}"; do
    _ray_node_step "$node" --address="$RAY_ADDRESS"
  done
  if ! _ray_wait_nodes "${#nodes[@]}" $((wait_s - (SECONDS - start))); then
    echo "ray_cluster: only $(_ray_alive_nodes) of ${#nodes[@]} nodes registered with the Ray head at" \
      "$RAY_ADDRESS after ${wait_s}s (MEGARL_RAY_WAIT_S); see $MEGARL_LOG_DIR/ray-<node>.log" >&2
    return 1
  fi
  echo "ray_cluster: all ${#nodes[@]} node(s) up after $((SECONDS - start))s"
}

ray_cluster_down() {
  [ "${#RAY_CLUSTER_STEPS[@]}" -eq 0 ] && return 0
  echo "ray_cluster: stopping ${#RAY_CLUSTER_STEPS[@]} node(s)"
  kill -TERM "${RAY_CLUSTER_STEPS[@]}" 2>/dev/null || true
  local pid deadline=$((SECONDS + ${MEGARL_RAY_STOP_S:-60}))
  for pid in "${RAY_CLUSTER_STEPS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
      sleep 1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  RAY_CLUSTER_STEPS=()
}
