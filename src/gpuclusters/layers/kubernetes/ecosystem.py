"""The ecosystem tools' own release manifests, with only their image
references rewritten to the images built here (docs/ecosystem/*.md).

``python -m gpuclusters.layers.kubernetes.ecosystem render kueue > kueue.yaml``

Each tool is installed exactly as its project publishes it: Kueue's
``manifests.yaml`` is ``kustomize build config/default`` of its release
(its Makefile's ``artifacts`` target; ``kubectl kustomize`` is the same
kustomize), Volcano's is ``installer/volcano-development.yaml`` and the MPI
Operator's ``deploy/v2beta1/mpi-operator.yaml``, all read from the released
modules ``scripts/build-k8s-addons`` keeps. The one change is each
``image:`` reference, from the project's registry to ``localhost/NAME:TAG``:
every node's containerd resolves ``localhost/...`` in the cluster's image
registry, where ``scripts/build-images`` images are pushed (docs/kubernetes.md
"Images"), so the same file works on every cluster of every server. An
``image:`` the map does not know is an error rather than a silent pull from
the internet.

Where nodes reach the internet, the unmodified upstream manifests work too.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR

ADDONS_SRC = Path("/var/cache/gpuclusters/addons/src")
LOCAL = "localhost"
_IMAGE_LINE = re.compile(r"^(?P<lead>\s*-?\s*image:\s*)(?P<q>[\"']?)(?P<ref>[^\s\"']+)(?P=q)\s*$")


class ManifestError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    version: str
    source: str  # the module directory under ADDONS_SRC
    manifest: str  # a file in it, or a kustomize directory (ending in '/')
    # upstream image reference (a prefix up to the tag) -> local image
    images: dict[str, str] = field(default_factory=dict)


TOOLS = {
    t.name: t
    for t in (
        Tool(
            "kueue",
            "v0.17.0",
            "kueue",
            "config/default/",
            # The kustomize tree names the staging image; the release sets
            # registry.k8s.io/kueue/kueue:<version>. Either maps here.
            {
                "us-central1-docker.pkg.dev/k8s-staging-images/kueue/kueue:": "kueue:v0.17.0",
                "registry.k8s.io/kueue/kueue:": "kueue:v0.17.0",
            },
        ),
        Tool(
            "volcano",
            "v1.14.1",
            "volcano",
            "installer/volcano-development.yaml",
            {
                f"docker.io/volcanosh/{n}:": f"{n}:v1.14.1"
                for n in ("vc-webhook-manager", "vc-controller-manager", "vc-scheduler")
            },
        ),
        Tool(
            "mpi-operator",
            "v0.8.0",
            "mpi-operator",
            "deploy/v2beta1/mpi-operator.yaml",
            {"mpioperator/mpi-operator:": "mpi-operator:v0.8.0"},
        ),
    )
}


def rewrite_images(text: str, images: dict[str, str]) -> str:
    """Every ``image:`` line's reference mapped to ``localhost/...``;
    :class:`ManifestError` for one the map does not cover."""
    out = []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        m = _IMAGE_LINE.match(line.rstrip("\n"))
        if m is None:
            out.append(line)
            continue
        ref = m["ref"]
        local = next((v for k, v in images.items() if ref.startswith(k)), None)
        if local is None:
            if ref.startswith(f"{LOCAL}/"):
                out.append(line)
                continue
            raise ManifestError(f"line {number}: no local image for {ref!r}")
        out.append(f"{m['lead']}{LOCAL}/{local}\n")
    return "".join(out)


def upstream_manifest(tool: Tool, *, src: Path = ADDONS_SRC, kubectl: Path | None = None) -> str:
    root = src / tool.source
    if not root.is_dir():
        raise ManifestError(f"{root} is missing: run scripts/build-k8s-addons {tool.source}")
    if tool.manifest.endswith("/"):
        binary = kubectl or DEFAULT_BIN_DIR / "kubectl"
        try:
            built = subprocess.run(
                [str(binary), "kustomize", str(root / tool.manifest)],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise ManifestError(f"kustomize build of {tool.name}: {exc}") from exc
        return built.stdout
    return (root / tool.manifest).read_text()


def render(name: str, *, src: Path = ADDONS_SRC) -> str:
    tool = TOOLS.get(name)
    if tool is None:
        raise ManifestError(f"unknown tool {name!r}: one of {', '.join(sorted(TOOLS))}")
    return rewrite_images(upstream_manifest(tool, src=src), tool.images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="print a tool's release manifest, images rewritten")
    r.add_argument("tool", choices=sorted(TOOLS))
    args = parser.parse_args()
    try:
        sys.stdout.write(render(args.tool))
    except ManifestError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
