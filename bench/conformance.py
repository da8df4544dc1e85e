"""The Kubernetes conformance suite against a 2-node cluster of the embedded fleet.

What it does, as an operator would by hand (docs/kubernetes.md "Conformance"):

1. starts a real ``gpuclusters server --provider netns`` (fresh home under
   /tmp, the API over TLS, the image registry on a gateway address of the
   benches' own);
2. creates a ``kubernetes`` cluster of two 8-GPU nodes and waits for it;
3. ``gpuclusters registry login`` and pushes the suite's images (built by
   ``imagebuild.conformance``, upstream names kept) with ``skopeo copy`` into the
   project's repositories, as any user pushes theirs;
4. writes ``KUBE_TEST_REPO_LIST``, mapping the registries ``e2e.test``
   names (registry.k8s.io, registry.k8s.io/e2e-test-images) to those
   repositories; nothing else about the suite changes;
5. runs ``ginkgo -p`` over ``e2e.test`` with the cluster's kubeconfig
   (``gpuclusters clusters credentials``), focus ``[Conformance]``, skip
   ``[Serial]|[Disruptive]`` by default;
6. prints passed / failed / skipped and each failure's spec and first
   line, from the JUnit report; then deletes the cluster and stops the
   server (``--keep`` leaves both running for a look).

bench/conformance.sh builds what it needs first; run that. The report
directory (JUnit XML, the ginkgo log, the server log) is kept.

    bench/conformance.sh                              # ~1-2 h on 2 cores
    bench/conformance.sh --focus 'DNS.*\\[Conformance\\]' --procs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from _server import BenchServer, free_port, wait

from gpuclusters.imagebuild import conformance as ci
from gpuclusters.layers.kubernetes import config as k8s_config

P = "/v1/projects/default"
CLUSTER = "conformance"


def say(message: str) -> None:
    print(f"conformance: {message}", file=sys.stderr, flush=True)


def push_images(server: BenchServer, home: Path, registry: str) -> dict[str, str]:
    """Push every conformance image into the project; returns the
    KUBE_TEST_REPO_LIST entries."""
    env = {**server.env, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "REGISTRY_AUTH_FILE": str(home / "auth.json")}  # fmt: skip
    login = json.loads(
        subprocess.run(
            [str(server.exe), "registry", "login", "--output", "json"],
            env=env, capture_output=True, text=True, check=True, timeout=60,
        ).stdout
    )  # fmt: skip
    cache = ci.cache_dir()
    mapping = {
        ci.E2E_REGISTRY: f"{registry}/e2e-test-images",
        ci.K8S_REGISTRY: f"{registry}/k8s",
    }
    for recipe in ci.conformance_recipes():
        archive = recipe.archive(cache)
        if not archive.is_file():
            raise SystemExit(f"{archive} is missing: run bench/conformance.sh (it builds it)")
        dest = f"{mapping[recipe.prefix]}/{recipe.name}:{recipe.tag}"
        cmd = ["skopeo", "copy", "--quiet", f"oci-archive:{archive}", f"docker://{dest}"]
        if login.get("ca_file"):
            cmd[2:2] = ["--dest-cert-dir", str(Path(login["ca_file"]).parent)]
        subprocess.run(cmd, env=env, check=True, timeout=600)
        say(f"pushed {dest}")
    return {
        # registry.k8s.io/e2e-test-images
        "promoterE2eRegistry": mapping[ci.E2E_REGISTRY],
        # registry.k8s.io (pause, etcd)
        "gcRegistry": mapping[ci.K8S_REGISTRY],
        "gcEtcdRegistry": mapping[ci.K8S_REGISTRY],
    }


SUITE_NODES = (
    "[SynchronizedBeforeSuite]",
    "[SynchronizedAfterSuite]",
    "[BeforeSuite]",
    "[AfterSuite]",
    "[ReportAfterSuite]",
    "[ReportBeforeSuite]",
    "[DeferCleanup (Suite)]",
)


def summarize(junit: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Counts of the selected specs (ginkgo lists the ones its focus and skip
    left out as skipped with the bare message "skipped"; a spec that skips
    itself at run time says why), and each failure with its first line."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "not selected": 0}
    failures: list[tuple[str, str]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped")
        if name.startswith(SUITE_NODES):
            if failed:
                failures.append((name, _first_line(case)))
        elif skipped is not None:
            key = "not selected" if skipped.get("message") == "skipped" else "skipped"
            counts[key] += 1
        elif failed:
            counts["failed"] += 1
            failures.append((name, _first_line(case)))
        else:
            counts["passed"] += 1
    return counts, failures


def report(junit: Path, minutes: float | None, procs: int | None) -> int:
    counts, failures = summarize(junit)
    took = f"  in {minutes:.1f} min (--procs {procs})" if minutes is not None else ""
    print(f"passed {counts['passed']}  failed {counts['failed']}  skipped {counts['skipped']}"
          f"  (not selected {counts['not selected']}){took}")  # fmt: skip
    for name, why in failures:
        print(f"FAILED {name}\n       {why}")
    return 0 if not failures else 1


def _first_line(case: ET.Element) -> str:
    for tag in ("failure", "error"):
        el = case.find(tag)
        if el is not None:
            text = (el.get("message") or el.text or "").strip()
            return text.splitlines()[0][:300] if text else ""
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--focus", default=r"\[Conformance\]")
    parser.add_argument("--skip", default=r"\[Serial\]|\[Disruptive\]")
    parser.add_argument("--procs", type=int, default=4, help="ginkgo parallel processes")
    parser.add_argument("--timeout", default="4h", help="ginkgo's suite timeout")
    parser.add_argument("--report-dir", type=Path)
    parser.add_argument("--keep", action="store_true", help="leave the cluster and server up")
    parser.add_argument("--summarize", type=Path, metavar="JUNIT", help="only print a report's")
    args = parser.parse_args()
    if args.summarize:
        return report(args.summarize, None, None)

    bin_dir = ci.conformance_root() / f"v{k8s_config.K8S_VERSION}" / "bin"
    out_dir = args.report_dir or Path(
        f"/tmp/gpuclusters-conformance-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"reports in {out_dir}")
    server = BenchServer(
        "gpc-conformance-",
        settings={
            "GPUCLUSTERS_TLS": "on",
            "GPUCLUSTERS_TLS_PORT": str(free_port()),
            "GPUCLUSTERS_REGISTRY_PORT": str(free_port()),
            "GPUCLUSTERS_REGISTRY_TOKEN_PORT": str(free_port()),
            "GPUCLUSTERS_METRICS_DB_PORT": str(free_port()),
            "GPUCLUSTERS_METRICS_ALERT_PORT": str(free_port()),
        },
    )
    cluster_path: str | None = f"{P}/clusters/{CLUSTER}"
    started = time.monotonic()
    try:
        r = server.api.post(f"{P}/clusters", json={"name": CLUSTER, "cluster_type": "kubernetes",
                                                   "num_gpus": 16})  # fmt: skip
        r.raise_for_status()
        say("creating a 2-node Kubernetes cluster")
        cluster: dict[str, Any] = wait(
            "the cluster",
            lambda: (c := server.get(f"{P}/clusters/{CLUSTER}"))["status"] == "ready" and c,
            timeout=900,
            poll=2,
        )
        say(f"cluster ready in {time.monotonic() - started:.0f} s")
        work = server.home / "user"
        work.mkdir()
        kubeconfig = work / "kubeconfig"
        server.cli("clusters", "credentials", CLUSTER, "--file", str(kubeconfig))
        repo_list = push_images(server, work, cluster["registry"])
        (out_dir / "repo-list.yaml").write_text(
            "".join(f"{k}: {v}\n" for k, v in sorted(repo_list.items()))
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("GPUCLUSTERS_")},
            "KUBE_TEST_REPO_LIST": str(out_dir / "repo-list.yaml"),
            "KUBECONFIG": str(kubeconfig),
            "PATH": f"{k8s_config.DEFAULT_BIN_DIR}:{os.environ.get('PATH', '')}",
        }
        cmd = [
            str(bin_dir / "ginkgo"),
            f"--procs={args.procs}",
            f"--focus={args.focus}",
            f"--skip={args.skip}",
            f"--timeout={args.timeout}",
            "--no-color",
            "--junit-report=junit.xml",
            f"--output-dir={out_dir}",
            str(bin_dir / "e2e.test"),
            "--",
            f"--kubeconfig={kubeconfig}",
            "--provider=local",
            f"--report-dir={out_dir}",
            "--allowed-not-ready-nodes=0",
        ]
        say("running: " + " ".join(cmd))
        suite_started = time.monotonic()
        with (out_dir / "ginkgo.log").open("wb") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        minutes = (time.monotonic() - suite_started) / 60
        junit = out_dir / "junit.xml"
        if not junit.is_file():
            say(f"ginkgo exited {rc} without a report; see {out_dir / 'ginkgo.log'}")
            return 1
        say(f"ginkgo exited {rc}")
        if args.keep:
            cluster_path = None
            say(f"kept: server home {server.home}, kubeconfig {kubeconfig}")
        return report(junit, minutes, args.procs)
    finally:
        shutil.copy(server.home / "server.log", out_dir / "server.log")
        if cluster_path is not None:
            server.close(cluster_path)


if __name__ == "__main__":
    sys.exit(main())
