#!/usr/bin/env bash
# A newcomer's first hour, timed on a fresh machine of this kind (docs/benchmarks.md
# "A fresh machine").
#
#   bench/fresh_machine.sh [--commit REV] [--ci] [--keep]
#
# The "machine": a new Debian 12 root (mmdebstrap) with what a machine of this
# kind has before anyone runs anything (git, gcc, make, curl, Debian's own
# Python 3.11 without venv support, the Go toolchain of /usr/local/go, this
# machine's CA bundle and pip/CA environment variables, /opt/wheels), entered
# with pivot_root in mount and PID namespaces of its own. It shares this machine's
# kernel, cgroups and network namespace (the embedded fleet's namespaces,
# bridges and iptables chains are made in it, as on a real machine), and has no
# caches: no apt packages beyond those, no Go module or build cache, no
# /var/cache/gpuclusters, no pip cache. In it, as root in /root/gpuclusters
# (`git clone` of REV of this checkout, default HEAD):
#
#   1. `scripts/up --detach`, timed from the clone to its return (the server answers);
#   2. the README's quickstart block (the first ```bash block under "## Quickstart",
#      its first line being step 1), each line as written, stdin from /dev/null,
#      timed; the first `clusters create ... --wait` is "first cluster ready";
#   3. `gpuclusters builds --wait`: until the background builds are done;
#   4. `gpuclusters down --purge`, then what is left: network namespaces, GPC-*
#      iptables chains, gpuclusters processes.
# With --ci, instead: `.ci/run` alone, timed (set-up from nothing, then every test).
#
# Prints one line per step with its seconds since the clone, and writes them to
# /tmp/gpct-fresh/times.tsv (the logs and the builder's status.json beside it, in logs/). Needs root, 25-70 minutes and about 20 GB of disk.
# Run nothing else meanwhile: the figures are wall times on 2 cores, and
# another gpuclusters server would share the network namespace.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="$(pwd -P)"

COMMIT=HEAD
CI=0
KEEP=0
while (($#)); do
    case "$1" in
    --commit) COMMIT="$2"; shift 2 ;;
    --ci) CI=1; shift ;;
    --keep) KEEP=1; shift ;;
    *) echo "fresh_machine.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
((EUID == 0)) || { echo "fresh_machine.sh: run as root" >&2; exit 1; }
REV="$(git rev-parse "$COMMIT")"

WORK=/tmp/gpct-fresh
ROOT="$WORK/root"
if [[ -e "$WORK" ]]; then
    echo "fresh_machine.sh: $WORK exists (a run in progress, or --keep): remove it first" >&2
    exit 1
fi
mkdir -p "$WORK"

say() { printf 'fresh: %s\n' "$*" >&2; }

say "building the fresh root in $ROOT"
mmdebstrap --variant=minbase --include=git,ca-certificates,gcc,libc6-dev,make,curl,python3,procps,xz-utils \
    bookworm "$ROOT" http://deb.debian.org/debian >"$WORK/mmdebstrap.log" 2>&1
cp -a /usr/local/go "$ROOT/usr/local/go"
cp -a /etc/ssl/certs/. "$ROOT/etc/ssl/certs/"
[[ -d /usr/local/share/ca-certificates ]] && cp -a /usr/local/share/ca-certificates/. "$ROOT/usr/local/share/ca-certificates/"
[[ -d /opt/wheels ]] && mkdir -p "$ROOT/opt" && cp -a /opt/wheels "$ROOT/opt/wheels"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# This machine's Debian sources (the mirror it is allowed to reach), not mmdebstrap's.
rm -f "$ROOT/etc/apt/sources.list"
cp -a /etc/apt/sources.list.d/. "$ROOT/etc/apt/sources.list.d/"
[[ -f /etc/apt/sources.list ]] && cp /etc/apt/sources.list "$ROOT/etc/apt/sources.list"
git clone -q --no-checkout "$SRC" "$WORK/src.git"
git -C "$WORK/src.git" checkout -q "$REV"

# What runs inside: the clone, then each step with its time since the clone.
cat >"$ROOT/fresh-run.sh" <<'EOF'
#!/bin/bash
set -uo pipefail
export HOME=/root PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export TERM=dumb
T0=$(date +%s%N)
mark() { # STEP COMMAND: seconds since the clone began
    local ms=$((($(date +%s%N) - T0) / 1000000))
    printf '%s\t%d.%d\t%s\n' "$1" $((ms / 1000)) $((ms % 1000 / 100)) "$2" | tee -a /times.tsv
}
git clone -q /src.git /root/gpuclusters && cd /root/gpuclusters || exit 1
mark clone ok
if [[ "${GPCT_CI:-0}" == 1 ]]; then
    .ci/run >/ci.log 2>&1
    mark ".ci/run rc=$?" ".ci/run"
    tail -n 5 /ci.log
    exit 0
fi
# The README's quickstart block, line by line (the first line is `scripts/up --detach`).
awk '/^## Quickstart/{f=1} f&&/^```bash/{b=1; next} b&&/^```/{exit} b' README.md >/quickstart.sh
n=0
while IFS= read -r line; do
    cmd="${line%%  #*}"
    [[ -z "${cmd// }" || "$cmd" == \#* ]] && continue
    n=$((n + 1))
    rc=0
    eval "$cmd" </dev/null >>/quickstart.log 2>&1 || rc=$?
    mark "quickstart $n rc=$rc" "$cmd"
    if ((rc != 0)); then
        echo "FAILED: $cmd (see /quickstart.log)" >&2
    fi
done </quickstart.sh
.venv/bin/gpuclusters builds --wait >>/quickstart.log 2>&1; mark "builds done rc=$?" "gpuclusters builds --wait"
.venv/bin/gpuclusters down --purge >>/quickstart.log 2>&1; mark "down --purge rc=$?" "gpuclusters down --purge"
echo "netns: $(ip netns list | wc -l); chains: $(iptables-save 2>/dev/null | grep -c '^:GPC' || true); servers: $(pgrep -fc 'gpuclusters (up|server)' || true)" | tee -a /times.tsv
EOF
chmod +x "$ROOT/fresh-run.sh"
mkdir -p "$ROOT/src.git"

say "running in the fresh root (log: $ROOT/quickstart.log, times: $ROOT/times.tsv)"
rc=0
unshare --mount --pid --fork --propagation private bash -c '
    set -e
    R="$1"
    # pivot_root, not chroot: the kernel refuses user namespaces (every node
    # has one) to a process whose root is not its mount namespace'"'"'s root.
    mount --bind "$R" "$R"
    mount --rbind /sys "$R/sys"; mount --make-rslave "$R/sys"
    mount --rbind /dev "$R/dev"; mount --make-rslave "$R/dev"
    mount -t proc proc "$R/proc"
    mount -t tmpfs -o mode=0755 tmpfs "$R/run"
    mount --bind "$2" "$R/src.git"
    cd "$R"
    mkdir -p .oldroot
    pivot_root . .oldroot
    exec /usr/bin/env -i GPCT_CI="$3" \
        SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt SSL_CERT_DIR=/etc/ssl/certs \
        REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt CURL_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_FIND_LINKS=/opt/wheels /bin/sh -c "umount -l /.oldroot && rmdir /.oldroot && exec /fresh-run.sh"
' _ "$ROOT" "$WORK/src.git" "$CI" || rc=$?
# What stays after the root is gone: the times, the logs, the builder's status.
cp "$ROOT/times.tsv" "$WORK/times.tsv" 2>/dev/null || true
mkdir -p "$WORK/logs"
for f in quickstart.log ci.log var/cache/gpuclusters/builds/status.json var/cache/gpuclusters/builds/runner.log; do
    [[ -f "$ROOT/$f" ]] && cp "$ROOT/$f" "$WORK/logs/"
done
cp -r "$ROOT/var/cache/gpuclusters/builds/logs" "$WORK/logs/builds" 2>/dev/null || true
say "exit code $rc; times:"
cat "$WORK/times.tsv" >&2 || true
if ((!KEEP)); then
    # Nothing of the root may be mounted any more (the PID namespace's end
    # took its processes, the mount namespace's end its mounts).
    if grep -q " $ROOT" /proc/self/mounts; then
        say "mounts under $ROOT remain: leaving it"
    else
        rm -rf --one-file-system "$ROOT"
    fi
fi
exit "$rc"
