#!/usr/bin/env bash
# Node isolation (docs/security.md) against an older revision, side by side on
# one machine in one run: Slurm and Kubernetes create -> ready (bench/provision.py,
# bench/k8s_provision.py) and node-to-node TCP throughput (bench/node_tcp.py),
# each version in turn, ROUNDS times (alternating, so drift hits both alike).
# The older revision runs from a git worktree with this checkout's .venv
# (PYTHONPATH puts its src first; the server subprocess inherits it).
#
#   bench/node_boundary.sh [OLD_REV] [ROUNDS]     # default 3a9c9a5 (before issue 24), 2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OLD="${1:-3a9c9a5}"
ROUNDS="${2:-2}"
PY="$PWD/.venv/bin/python"
TREE="$(mktemp -d /tmp/gpc-bench-old-XXXXXX)"
git worktree add -q --detach "$TREE/tree" "$OLD"
trap 'git worktree remove --force "$TREE/tree"; rm -rf "$TREE"' EXIT

for round in $(seq "$ROUNDS"); do
    for version in old new; do
        if [[ $version == old ]]; then root="$TREE/tree"; else root="$PWD"; fi
        echo "===== round $round, $version ($(git -C "$root" rev-parse --short HEAD))"
        export PYTHONPATH="$root/src"
        (cd "$root" && "$PY" bench/provision.py --sizes 1 2 --repeat 2) | grep '^|'
        (cd "$root" && "$PY" bench/k8s_provision.py --sizes 1 2 --repeat 2) |
            sed -n '/^nodes/,/^$/p'
        # node_tcp.py is new with this work: the same script drives both.
        "$PY" "$PWD/bench/node_tcp.py" --repeat 5 --mib 2048 | tail -1
        unset PYTHONPATH
    done
done
