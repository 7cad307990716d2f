#!/usr/bin/env bash
# GRPO on an ORS environment across several GPUs and nodes. Run the same command on every node.
#
#   # one node, 8 GPUs, each training process with its own colocated vLLM engine:
#   TARGET=http://10.0.0.5:8000 examples/multi_gpu.sh
#
#   # two nodes (run on both; NODE_RANK=0 on the node whose address is MASTER_ADDR):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 TARGET=Eigent/SETA examples/multi_gpu.sh --model Qwen/Qwen3-4B
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 TARGET=Eigent/SETA examples/multi_gpu.sh --model Qwen/Qwen3-4B
#
# TARGET is the ORS server URL (it must be reachable from every node; `ors-trl serve-echo` binds loopback only,
# so for several nodes serve your environment on an address they can reach) or a catalog name, which needs
# OPENREWARD_API_KEY exported on every node. Every process opens, pings and closes its own sessions (about
# --per-device-batch at a time); ORS_TRL_MAX_SESSIONS=N caps them per process. Extra arguments go to the script
# (SCRIPT, default examples/vllm_server.py, with SCRIPT_ARGS, default --colocate; see its --help).
# DRY_RUN=1 prints the command instead.
set -euo pipefail

: "${TARGET:?set TARGET to an ORS server URL or a catalog name}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  GPUS_PER_NODE="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
  [[ "$GPUS_PER_NODE" -gt 0 ]] || GPUS_PER_NODE=1
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCRIPT="${SCRIPT:-$HERE/vllm_server.py}"
read -r -a SCRIPT_ARGS <<< "${SCRIPT_ARGS---colocate}"  # SCRIPT_ARGS="" for none
NUM_PROCESSES="$((NNODES * GPUS_PER_NODE))"
MULTI=()
[[ "$NUM_PROCESSES" -gt 1 ]] && MULTI=(--multi_gpu)

if [[ "$TARGET" != *"://"* && -z "${OPENREWARD_API_KEY:-}" ]]; then
  echo "TARGET=$TARGET is a catalog name: export OPENREWARD_API_KEY on every node" >&2
  exit 2
fi

cmd=(accelerate launch "${MULTI[@]}"
     --num_machines "$NNODES" --machine_rank "$NODE_RANK"
     --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT"
     --num_processes "$NUM_PROCESSES"
     "$SCRIPT" "$TARGET" "${SCRIPT_ARGS[@]}" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
