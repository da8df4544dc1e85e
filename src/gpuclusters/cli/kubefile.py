"""The kubeconfig file on the user's machine: where it is, reading it, and
writing it safely.

* Where: an explicit path, else the first entry of ``$KUBECONFIG`` (kubectl
  writes new entries there too), else ``~/.kube/config``.
* Reading: an absent or empty file is an empty kubeconfig; a file that is not
  a kubeconfig is an error *before* anything is fetched or written, so a
  typo'd path never turns a user's unrelated file into a kubeconfig.
* Writing: the file holds private keys, so it is written to a temporary file
  in the same directory with mode 0600, flushed to disk and renamed over the
  target (readers see the old or the new file, never half of one; a crash
  leaves the old one). Missing parent directories are created 0700. A
  symlinked kubeconfig is written through to its target, as kubectl does.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuclusters.core import kubeconfig
from gpuclusters.core.errors import ValidationError


def default_path(env: Mapping[str, str] | None = None) -> Path:
    """The file kubectl would write to: ``$KUBECONFIG``'s first entry, else
    ``~/.kube/config``."""
    env = os.environ if env is None else env
    for entry in env.get("KUBECONFIG", "").split(os.pathsep):
        if entry.strip():
            return Path(entry.strip()).expanduser()
    return Path.home() / ".kube" / "config"


def read(path: Path) -> dict[str, Any]:
    """The kubeconfig at ``path`` (empty if the file does not exist). Raises
    ``ValidationError`` if it cannot be read or is not a kubeconfig."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return kubeconfig.empty()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValidationError(f"cannot read {path}: {reason}", field="file") from exc
    try:
        return kubeconfig.load(text)
    except ValueError as exc:
        raise ValidationError(
            f"{path} is not a valid kubeconfig ({exc}); it was left unchanged "
            "(use --file to write elsewhere)",
            field="file",
        ) from exc


def _make_private_dirs(directory: Path) -> None:
    missing: list[Path] = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)


def write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, mode 0600. Raises
    ``ValidationError`` naming the path if that fails."""
    target = path.resolve() if path.is_symlink() else path
    tmp: str | None = None
    try:
        _make_private_dirs(target.parent)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise ValidationError(f"cannot write {path}: {exc.strerror or exc}", field="file") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
