#!/usr/bin/env bash
# The Kubernetes conformance suite (e2e.test of the pinned release, ginkgo in
# parallel) against a 2-node Kubernetes cluster of the embedded fleet; prints
# passed / failed / skipped. Not in CI (an hour or more on 2 cores).
#
#   bench/conformance.sh [--procs N] [--focus RE] [--skip RE] [--keep] [--report-dir D]
#
# Builds what is missing first, each step cached like the rest of scripts/setup:
# the Kubernetes binaries, CoreDNS (agnhost's image carries it), e2e.test,
# ginkgo and the test binaries (scripts/build-conformance), then the suite's
# images (gpuclusters.imagebuild.conformance). Then
# bench/conformance.py does the run (its docstring says how). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || { echo "conformance.sh: run scripts/setup first" >&2; exit 1; }
scripts/build-k8s >/dev/null
scripts/build-k8s-addons coredns >/dev/null
scripts/build-conformance >/dev/null
.venv/bin/python -m gpuclusters.imagebuild.conformance build
exec .venv/bin/python bench/conformance.py "$@"
