"""``gpuclusters builds``: what scripts/setup's background builder still
builds on this machine (core/builds.py), and the progress lines ``gpuclusters
up`` prints while it works.

The builder's status file is local (``$GPUCLUSTERS_BUILDS_DIR``, default
/var/cache/gpuclusters/builds/status.json), so this reads it directly, with
no server involved: it works before the server starts and while it is down.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpuclusters.builds import status as build_status
from gpuclusters.cli.context import OutputFormat, OutputOpt, stderr_console
from gpuclusters.core.builds import StepState, summary

PROGRESS_POLL_S = 5.0


def current_line() -> str | None:
    """The builder's one-line summary, or None when no build ever ran."""
    observed = build_status.read()
    if observed is None:
        return None
    return summary(observed.status, alive=observed.alive, now=time.time())


class ProgressPrinter(threading.Thread):
    """Prints the builder's summary on stderr whenever a step starts or
    ends, until the builder is done (``gpuclusters up`` in the foreground)."""

    def __init__(self, interval_s: float = PROGRESS_POLL_S) -> None:
        super().__init__(name="build-progress", daemon=True)
        self.interval_s = interval_s
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        err = stderr_console()
        last: object = None
        while not self._halt.is_set():
            observed = build_status.read()
            if observed is None:
                return  # no background build on this machine
            shape = (observed.alive, [(s.name, s.state) for s in observed.status.steps])
            if shape != last:
                err.print(summary(observed.status, alive=observed.alive, now=time.time()))
                last = shape
            if not observed.alive:
                return
            self._halt.wait(self.interval_s)


def builds(
    *,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="wait until the background builder has finished"),
    ] = False,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """What scripts/setup still builds in the background (add-ons and
    images), and how long each step took. Exit code 1 if a step failed."""
    if wait:
        printer = ProgressPrinter()
        printer.start()
        while (observed := build_status.read()) is not None and observed.alive:
            time.sleep(1.0)
        printer.stop()
        printer.join()
    observed = build_status.read()
    if output is OutputFormat.JSON:
        doc = None if observed is None else {**observed.status.as_json(), "alive": observed.alive}
        typer.echo(json.dumps(doc, indent=2))
    elif observed is None:
        typer.echo("no background build has run on this machine (scripts/setup starts one)")
    else:
        table = Table("STEP", "STATE", "SECONDS", "LOG / ERROR", box=None)
        for s in observed.status.steps:
            seconds = f"{s.seconds:.0f}" if s.seconds is not None else ""
            if s.state is StepState.BUILDING and s.started_at is not None:
                seconds = f"{time.time() - s.started_at:.0f}…"
            table.add_row(s.name, s.state.value, seconds, s.error or s.log)
        typer.echo(summary(observed.status, alive=observed.alive, now=time.time()))
        Console().print(table)
    if observed is not None and observed.status.failed():
        raise typer.Exit(1)
