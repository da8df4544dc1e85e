"""Where the client finds its server, key and project.

Precedence, lowest first: ``$GPUCLUSTERS_HOME/config.toml`` (see
:mod:`gpuclusters.core.clientconfig`, written by the server on first start),
then the environment (``GPUCLUSTERS_URL``, ``GPUCLUSTERS_API_KEY``,
``GPUCLUSTERS_PROJECT``), then explicit arguments. Empty strings count as
unset at every level, so ``GPUCLUSTERS_PROJECT=`` does not blank the project.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuclusters.core.clientconfig import (
    DEFAULT_PROJECT,
    DEFAULT_URL,
    default_home,
    read_config,
)

ENV_URL = "GPUCLUSTERS_URL"
ENV_API_KEY = "GPUCLUSTERS_API_KEY"
ENV_PROJECT = "GPUCLUSTERS_PROJECT"


def _first(*values: str | None) -> str | None:
    for value in values:
        if value:
            return value
    return None


@dataclass(frozen=True)
class ClientConfig:
    url: str = DEFAULT_URL
    api_key: str | None = None
    project: str = DEFAULT_PROJECT

    @classmethod
    def load(
        cls,
        *,
        url: str | None = None,
        api_key: str | None = None,
        project: str | None = None,
        home: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ClientConfig:
        """Merge file < environment < arguments.

        ``home`` defaults to ``$GPUCLUSTERS_HOME`` or ``~/.gpuclusters``;
        ``environ`` defaults to ``os.environ`` (tests pass a dict).
        """
        env = os.environ if environ is None else environ
        stored = read_config(home if home is not None else default_home(env))
        return cls(
            url=_first(url, env.get(ENV_URL), stored.url) or DEFAULT_URL,
            api_key=_first(api_key, env.get(ENV_API_KEY), stored.api_key),
            project=_first(project, env.get(ENV_PROJECT), stored.project) or DEFAULT_PROJECT,
        )
