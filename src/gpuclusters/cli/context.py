"""What every command shares: the client factory, common options, errors.

``client_factory`` is a module attribute on purpose: tests replace it (with a
client on an ``httpx.MockTransport``) and every command picks the replacement
up, because commands call :func:`open_client`, which looks it up at call time.

:func:`api_command` wraps a command body so that any
:class:`~gpuclusters.core.errors.GpuClustersError` (server answers, connection
failures, failed waits) is printed as ``error [<code>]: <message>`` on stderr
and ends the process with status 1; stdout stays empty.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from gpuclusters.client import Client
from gpuclusters.core.errors import GpuClustersError
from gpuclusters.core.paging import Page

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

POLL_INTERVAL_S = 1.0
"""How often ``--wait`` polls; tests set it to 0."""


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"


OutputOpt = Annotated[
    OutputFormat,
    typer.Option(
        "--output",
        "-o",
        envvar="GPUCLUSTERS_OUTPUT",
        case_sensitive=False,
        help="table for people, json for scripts (exactly the API objects)",
    ),
]
ProjectOpt = Annotated[
    str | None,
    typer.Option(
        "--project",
        "-p",
        show_default=False,
        help="project to act in (default: $GPUCLUSTERS_PROJECT, then config.toml, then 'default')",
    ),
]


LimitOpt = Annotated[
    int | None,
    typer.Option(
        "--limit",
        min=1,
        max=1000,
        show_default=False,
        help="show one page of at most this many (default: every page)",
    ),
]
CursorOpt = Annotated[
    str | None,
    typer.Option(
        "--cursor",
        show_default=False,
        help="start at this page (the cursor the previous page printed)",
    ),
]

ReasonOpt = Annotated[
    str | None,
    typer.Option("--reason", show_default=False, help="why it is forced (recorded); needs --force"),
]


def forced_reason(force: bool, reason: str | None) -> str | None:
    """What a ``--force --reason`` pair sends: the reason when forced (an
    empty one is refused by the server, naming the field), else None;
    ``--reason`` alone is a usage error."""
    if reason is not None and not force:
        raise typer.BadParameter("--reason goes with --force", param_hint="--reason")
    return (reason or "") if force else None


def one_or_every_page(
    limit: int | None,
    cursor: str | None,
    *,
    every: Callable[[], list[T]],
    page: Callable[[int | None, str | None], Page[T]],
) -> tuple[list[T], str | None]:
    """What a list command shows: every page (neither --limit nor --cursor
    given), or the one page asked for and the cursor of the next."""
    if limit is None and cursor is None:
        return every(), None
    one = page(limit, cursor)
    return one.items, one.next_cursor


def note_next_page(next_cursor: str | None) -> None:
    """Say how to get the next page (on stderr: stdout stays the list)."""
    if next_cursor is not None:
        stderr_console().print(f"more: --cursor {next_cursor}", style="dim", soft_wrap=True)


def _default_client_factory(project: str | None) -> Client:
    return Client.from_config(project=project)


client_factory: Callable[[str | None], Client] = _default_client_factory
"""Builds the client for one command; ``project=None`` means the configured one."""


def open_client(project: str | None = None) -> Client:
    return client_factory(project)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def report_error(exc: GpuClustersError) -> None:
    line = Text.assemble(("error", "bold red"), f" [{exc.code}]: {exc.message}")
    if exc.field:
        line.append(f" (field: {exc.field})")
    stderr_console().print(line, soft_wrap=True)


def api_command(func: Callable[P, R]) -> Callable[P, R]:
    """Turn domain errors raised by ``func`` into a message and exit status 1."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except GpuClustersError as exc:
            report_error(exc)
            raise typer.Exit(1) from exc

    return wrapper
