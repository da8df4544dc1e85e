#!/usr/bin/env bash
# Run the active GPU health checks on a real GPU machine and print their
# figures (one JSON line per check: state, reason, metrics).
#
#   bench/gpu_checks.sh                         # H100_SXM thresholds, 30 s burn
#   GPU_TYPE=H200_SXM DURATION=60 bench/gpu_checks.sh
#
# Needs PyTorch with CUDA in the Python it finds (PYTHON, default the
# project's .venv, else python3) and the gpuclusters package importable
# (PYTHONPATH=src works from a checkout). On a machine without a GPU every
# check prints "skipped: no GPU".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src"
for check in gpu-burn gpu-memory-bandwidth host-device nccl; do
    "$PY" -m gpuclusters.agent.checks "$check" \
        --duration "${DURATION:-30}" --gpu-type "${GPU_TYPE:-H100_SXM}" --scratch "${SCRATCH:-/tmp}"
done
"$PY" -m gpuclusters.agent.checks storage --scratch "${SCRATCH:-/tmp}"
