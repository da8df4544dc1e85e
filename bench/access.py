"""Users' access on the embedded fleet: SSH login times and revocation delay.

One Slurm cluster (8 GPUs) on the real server (``gpuclusters server
--provider netns``, fresh home under /tmp, public host 10.230.0.1 on lo,
default settings: access sync every 15 s, woken at once by API changes).
From this machine, as the admin (root's ssh client, but through the
gateway's DNAT exactly as a laptop's connection):

1. **cert login**: ``gpuclusters clusters ssh demo -- true`` end to end (an
   ephemeral key, the server signs it, ssh through the gateway, sshd checks
   the certificate and principals, PAM, the command, exit).
2. **key login**: plain ``ssh -p PORT admin@GATEWAY true`` with a
   registered key (the floor: what OpenSSH alone costs through the DNAT).
3. **direct**: the same ssh straight to the login node's address (no
   gateway), to show what the DNAT adds.
4. **revocation**: ``DELETE /v1/ssh-keys/{id}`` at T0, then plain ssh with
   that key every 0.2 s until refused: the delay until the key stops
   working; then the key is added again and the time until it works.

Prints min / median per figure; recorded in docs/benchmarks.md.

    .venv/bin/python bench/access.py                  # ~1 min on 2 cores
    .venv/bin/python bench/access.py --repeat 20
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _server import BenchServer, wait

P = "/v1/projects/default"
FLEET = "hosts:\n  - {name: h100-a-01, gpu_type: H100_SXM, region: local-1, ib_island: ib-a}\n"


def fmt(xs: list[float]) -> str:
    return f"{min(xs) * 1000:8.1f} / {statistics.median(xs) * 1000:8.1f} ms"


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, timeout=60, check=False)
    return time.perf_counter() - start, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()

    server = BenchServer("gpc-bench-access-", fleet=FLEET, settings={
        "GPUCLUSTERS_ACCEPTANCE_CHECKS": "[]",
    })  # fmt: skip
    path = f"{P}/clusters/demo"
    try:
        server.api.post(
            f"{P}/clusters", json={"name": "demo", "cluster_type": "slurm", "num_gpus": 8}
        ).raise_for_status()
        wait("ready", lambda: server.get(path)["status"] == "ready", timeout=300, poll=0.5)
        cluster = server.get(path)
        host, port = cluster["ssh_endpoint"]["host"], cluster["ssh_endpoint"]["port"]
        keydir = Path(tempfile.mkdtemp(prefix="gpc-bench-key-"))
        key = keydir / "id"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        added = server.api.post(
            "/v1/ssh-keys", json={"public_key": (keydir / "id.pub").read_text()}
        )
        added.raise_for_status()
        known = keydir / "known_hosts"
        ca = server.get("/v1/ssh-ca")
        shown = server.cli("clusters", "ssh", "demo", "--as-root", "--", "hostname", "-I")
        login = shown.split()[0]
        # The gateway's line, and the same CA for the login node's own address.
        known.write_text(
            f"{ca['known_hosts']}\n@cert-authority {login} {ca['host_ca_public_key']}\n"
        )
        ssh = [
            "ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={known}",
            "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes", "-i", str(key),
        ]  # fmt: skip
        through = [*ssh, "-p", str(port), f"admin@{host}", "true"]
        # The login node's certificate names its address too.
        direct = [*ssh, f"admin@{login}", "true"]
        cli = [str(server.exe), "clusters", "ssh", "demo", "--", "true"]
        wait("key login", lambda: timed(through)[1] == 0, timeout=60, poll=0.5)

        figures: dict[str, list[float]] = {"cert login": [], "key login": [], "direct": []}
        for _ in range(args.repeat):
            for name, argv, env in (
                ("cert login", cli, server.env),
                ("key login", through, None),
                ("direct", direct, None),
            ):
                took, rc = timed(argv, env)
                if rc != 0:
                    print(f"{name} failed (rc {rc})", file=sys.stderr)
                    return 1
                figures[name].append(took)

        revoke, restore = [], []
        key_id = added.json()["id"]
        for _ in range(max(3, args.repeat // 3)):
            t0 = time.perf_counter()
            server.api.delete(f"/v1/ssh-keys/{key_id}").raise_for_status()
            while timed(through)[1] == 0:
                time.sleep(0.2)
            revoke.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            again = server.api.post(
                "/v1/ssh-keys", json={"public_key": (keydir / "id.pub").read_text()}
            )
            again.raise_for_status()
            key_id = again.json()["id"]
            while timed(through)[1] != 0:
                time.sleep(0.2)
            restore.append(time.perf_counter() - t1)

        print(f"SSH through the gateway, {args.repeat} rounds (min / median):")
        for name, xs in figures.items():
            print(f"  {name:<12} {fmt(xs)}")
        print(f"  {'revocation':<12} {fmt(revoke)}   (key deleted -> next login refused)")
        print(f"  {'key added':<12} {fmt(restore)}   (key added -> first login works)")
        return 0
    finally:
        server.close(path)


if __name__ == "__main__":
    sys.exit(main())
