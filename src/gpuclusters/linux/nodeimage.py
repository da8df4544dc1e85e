"""The node image: the root file system nodes boot from.

``scripts/build-node-image`` builds it (a Debian 12 root with what nodes run,
no systemd, no secrets) as a plain directory cached on the machine. A node
booting from it (``linux/_nsinit.py``) binds the image's top-level
directories read-only into its root (idmapped onto its id block in a user
namespace) instead of the host's, and its /etc is an overlay over the
image's /etc, its accounts taken from the image (``linux/nodebase.py``).
What a node still takes from the host is bound on purpose, read-only, at
the same path: the server's Python runtime and package (the node agent),
the Kubernetes and add-on binaries (``providers/netns/config.py``
``runtime_paths``), the GPU driver's files and devices, and the node's own
directories (docs/security.md, "What a node sees of the host").
"""

from __future__ import annotations

from pathlib import Path

# Where scripts/build-node-image keeps its images: <key>/rootfs, complete
# once <key>/.complete exists. A build elsewhere (the script's
# GPUCLUSTERS_NODE_IMAGE_CACHE) is not looked for: name it with
# GPUCLUSTERS_NODE_IMAGE.
DEFAULT_CACHE = Path("/var/cache/gpuclusters/node-image")
# What the layers and the node's init rely on finding in an image.
NEEDS = ("etc/passwd", "usr/bin/python3", "usr/sbin/sshd", "usr/bin/nsenter")
# Top-level directories a node takes from its image only: a host path
# shared over them (a Debian host's Python lives in /usr) would hide the
# image's; the image's python3 is the same Debian release.
IMAGE_ONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib64")


class NodeImageError(ValueError):
    """Not a node root file system; the message says what is missing."""


def check(image: Path) -> None:
    """Refuse a directory that is not a built node image."""
    missing = [n for n in NEEDS if not (image / n).exists()]
    if not image.is_dir() or missing:
        raise NodeImageError(
            f"node image {image}: not a node root file system (missing: "
            f"{', '.join(missing) or 'the directory'}); build one with scripts/build-node-image"
        )


def hidden_by_image(path: Path) -> bool:
    """Whether a host path shared into nodes would cover the image's own."""
    return any(path == Path(d) or path.is_relative_to(d) for d in IMAGE_ONLY)


def newest_built(cache: Path = DEFAULT_CACHE) -> Path | None:
    """The root of the most recently completed image in ``cache`` (the one
    the current build script made: a changed script builds a new key beside
    the old ones), or None where none was built."""
    try:
        stamps = [(s.stat().st_mtime, s.parent / "rootfs") for s in cache.glob("*/.complete")]
    except OSError:
        return None
    built = [(t, root) for t, root in stamps if root.is_dir()]
    return max(built)[1] if built else None
