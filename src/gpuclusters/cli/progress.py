"""Live progress for ``--wait``, always on stderr.

The current phase and then every later phase transition is printed as its
own line when it is first seen (so a log of a non-interactive run shows the
whole progression), as is every change of the node summary (``2/2 nodes
running``). On a terminal a Rich spinner additionally shows the current
status; it is transient, so nothing of it is left behind. stdout is
untouched, which keeps ``--output json`` parseable.
"""

from __future__ import annotations

from types import TracebackType

from rich.status import Status
from rich.text import Text

from gpuclusters.cli.context import stderr_console
from gpuclusters.cli.render import clock, node_summary
from gpuclusters.core.enums import ClusterStatus
from gpuclusters.core.models import Cluster

_STYLE = {
    ClusterStatus.READY.value: "green",
    ClusterStatus.FAILED.value: "red",
    ClusterStatus.DEGRADED.value: "yellow",
    ClusterStatus.DELETING.value: "yellow",
    ClusterStatus.DELETED.value: "green",
}


class WaitProgress:
    """Feed it every changed cluster state via :meth:`update` (an ``on_change``)."""

    def __init__(self, name: str, *, goal: str) -> None:
        self.name = name
        self.goal = goal
        self.console = stderr_console()
        self._phases_seen = 0
        self._last_phase: str | None = None
        self._last_nodes: str | None = None
        self._last_errors: set[str] = set()  # failures already shown
        self._spinner: Status | None = None

    def __enter__(self) -> WaitProgress:
        self.console.print(f"waiting for cluster {self.name} to be {self.goal} ...", style="dim")
        if self.console.is_terminal:
            self._spinner = self.console.status(f"cluster {self.name}")
            self._spinner.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._spinner is not None:
            self._spinner.stop()
            self._spinner = None

    def _phase_line(self, when: str, phase: str, *, message: str) -> None:
        line = Text.assemble("  ", (when, "dim"), "  ", (phase, _STYLE.get(phase, "cyan")))
        if message:
            line.append(f"  {message}")
        self.console.print(line, soft_wrap=True)
        self._last_phase = phase

    def update(self, cluster: Cluster) -> None:
        if self._last_nodes is None:
            # First state: show where the cluster is now, not its whole past
            # (a delete would otherwise replay the create).
            self._phases_seen = max(0, len(cluster.phase_history) - 1)
        for transition in cluster.phase_history[self._phases_seen :]:
            if transition.phase != self._last_phase:  # already shown from the status
                self._phase_line(
                    clock(transition.timestamp), transition.phase, message=transition.message
                )
        self._phases_seen = len(cluster.phase_history)
        if cluster.status.value != self._last_phase:
            # A status the history does not (yet) record: show it anyway.
            self._phase_line(
                clock(cluster.updated_at), cluster.status.value, message=cluster.status_message
            )
        nodes = node_summary(cluster.nodes)
        if nodes != self._last_nodes:
            self.console.print(Text(f"  nodes: {nodes}", style="dim"))
            self._last_nodes = nodes
        # A step that keeps failing is said once per error, with its count,
        # so a wait that is not moving says why (not silence).
        failing = [(self.name, cluster.retries, cluster.last_error)] + [
            (n.name, n.retries, n.last_error) for n in cluster.nodes
        ]
        for who, retries, error in failing:
            key = f"{who}\0{error}"
            if retries and error and key not in self._last_errors:
                self._last_errors.add(key)
                self.console.print(
                    Text(f"  {who}: attempt {retries} failed: {error}", style="yellow"),
                    soft_wrap=True,
                )
        if self._spinner is not None:
            self._spinner.update(f"cluster {self.name}: {cluster.status.value} · {nodes}")

    def done(self, message: str, *, ok: bool = True) -> None:
        self.console.print(Text(message, style="bold green" if ok else "bold red"))
