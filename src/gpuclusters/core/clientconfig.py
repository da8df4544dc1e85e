"""The client configuration file: ``$GPUCLUSTERS_HOME/config.toml``.

This is the one file the server and the client share: the server writes it on
first start (URL and the bootstrap admin key), the CLI and SDK read it. It
lives in ``core`` because import-linter forbids the server from importing
``gpuclusters.client``; it holds only the file format, nothing about HTTP.

Format (all keys optional; unknown keys are ignored so newer files stay
readable)::

    url = "http://127.0.0.1:8470"
    api_key = "gpc_..."
    project = "default"
    ca_file = "/home/me/.gpuclusters/ca.pem"   # CA to verify an https url with

``gpuclusters login`` writes ``ca_file`` when the server's certificate is
signed by a CA of its own: a copy of that CA in ``$GPUCLUSTERS_HOME/ca.pem``
(:func:`write_ca_file`; a certificate is public, so mode 0644).

The file holds a secret, so it is written with mode 0600: a temporary file is
created with 0600 in the same directory, filled, fsynced and then renamed over
the old one, so a reader never sees a partial file or a moment with looser
permissions.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from gpuclusters.core.errors import GpuClustersError

ENV_HOME = "GPUCLUSTERS_HOME"
CONFIG_FILE_NAME = "config.toml"
CA_FILE_NAME = "ca.pem"
DEFAULT_URL = "http://127.0.0.1:8470"
DEFAULT_PROJECT = "default"

_KEYS = ("url", "api_key", "project", "ca_file")


class ClientConfigError(GpuClustersError):
    """The client configuration file cannot be read or is malformed."""

    code = "invalid_config"


@dataclass(frozen=True)
class StoredConfig:
    """What the file says; ``None`` for each key it does not set."""

    url: str | None = None
    api_key: str | None = None
    project: str | None = None
    ca_file: str | None = None


def default_home(environ: Mapping[str, str] | None = None) -> Path:
    """``$GPUCLUSTERS_HOME``, or ``~/.gpuclusters`` when unset or empty."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_HOME, "")
    return Path(value).expanduser() if value else Path.home() / ".gpuclusters"


def config_path(home: Path) -> Path:
    return home / CONFIG_FILE_NAME


def read_config(home: Path) -> StoredConfig:
    """Read ``home/config.toml``; a missing file is an empty configuration."""
    path = config_path(home)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return StoredConfig()
    except OSError as exc:
        raise ClientConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ClientConfigError(f"{path} is not valid TOML: {exc}") from exc
    values: dict[str, str | None] = {}
    for key in _KEYS:
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise ClientConfigError(
                f"{path}: {key} must be a string, got {type(value).__name__}", field=key
            )
        values[key] = value or None
    return StoredConfig(
        url=values["url"],
        api_key=values["api_key"],
        project=values["project"],
        ca_file=values["ca_file"],
    )


def replace_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write ``path`` through a temporary file in the same directory,
    fsynced and renamed over it: a reader sees the old file or the new one,
    never a part, and never looser permissions than ``mode``."""
    # mkstemp creates the file with 0600 already; fchmod makes the mode
    # explicit and independent of the platform's default.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def write_config(
    home: Path,
    *,
    url: str,
    api_key: str,
    project: str = DEFAULT_PROJECT,
    ca_file: str | None = None,
) -> Path:
    """Write ``home/config.toml`` atomically with mode 0600 and return its path.

    ``home`` is created (mode 0700) when missing. An existing file is replaced.
    ``ca_file`` is written only when given.
    """
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = config_path(home)
    values = {"url": url, "api_key": api_key, "project": project}
    if ca_file:
        values["ca_file"] = ca_file
    replace_atomically(path, tomli_w.dumps(values).encode("utf-8"), 0o600)
    return path


def write_ca_file(home: Path, pem: bytes) -> Path:
    """Write ``home/ca.pem`` (a CA certificate to trust) atomically with mode
    0644 and return its path; ``home`` is created (0700) when missing."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = home / CA_FILE_NAME
    replace_atomically(path, pem, 0o644)
    return path
