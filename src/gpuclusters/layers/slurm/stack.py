"""Bringing a Slurm cluster up and down through ``NodeShell``; the steps, not the policy.

Each function is one idempotent step the Slurm layer (and its reconciler) can
repeat after a crash: files are written only when they differ
(``write_file`` answers whether it changed anything), daemons are spawned by
name (a running one is left alone, or restarted when a file it reads only at
start changed), and every wait polls a real readiness signal with a short
backoff (``munge -n``, ``SELECT 1``, ``sacctmgr list cluster``,
``scontrol ping``, the node in ``sinfo --json`` with a fresh
``slurmd_start_time``); there are no fixed sleeps.

Order on the controller: munged -> mariadbd (first start: ``mariadb-install-db``;
then the ``slurm`` DB user) -> slurmdbd -> ``sacctmgr add cluster`` ->
slurmctld. slurmctld must find its cluster in slurmdbd before it starts, or
it registers under a cluster the database does not know.

Drain reasons we set start with ``gpuclusters:``; a drain set by anyone else
is never overwritten or cleared here (it is how users pick nodes for a
targeted scale-down).

Errors: a command that fails raises ``NodeCommandError`` (from the shell); a
wait that runs out raises ``LayerError`` (transient: the caller retries the
step later); Slurm refusing a node delete because jobs still run is a
``LayerError`` too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shlex
from collections.abc import Awaitable, Callable, Iterable, Sequence

from gpuclusters.core.enums import GPUS_PER_NODE
from gpuclusters.core.nodeshell import CommandResult, NodeShell
from gpuclusters.layers.base import LayerError
from gpuclusters.layers.slurm import config as cfg
from gpuclusters.layers.slurm.status import (
    AccountedJob,
    SlurmJob,
    SlurmNode,
    active_jobs_on,
    parse_sacct_json,
    parse_sinfo_json,
    parse_squeue_json,
)
from gpuclusters.layers.waiting import ok as _ok
from gpuclusters.layers.waiting import poll_until
from gpuclusters.layers.waiting import wait_for as wait_for

log = logging.getLogger(__name__)

REASON_PREFIX = "gpuclusters:"


# --- shared pieces ----------------------------------------------------------------------------


async def _ensure_dirs(shell: NodeShell, dirs: Iterable[cfg.Directory]) -> None:
    for d in dirs:
        await shell.run(cfg.mkdir_argv(d))


async def _respawn_if(shell: NodeShell, name: str, argv: Sequence[str], changed: bool) -> None:
    """Spawn ``name``; restart it first when a file it reads only at start changed."""
    if changed and await shell.is_running(name):
        log.info("%s: restarting %s (its configuration changed)", shell.hostname, name)
        await shell.stop(name)
    await shell.spawn(name, argv)


async def ensure_munge(
    shell: NodeShell, spec: cfg.SlurmSpec, *, munge_key: bytes, timeout_s: float = 10.0
) -> None:
    """The cluster's munge key and a running munged that answers on its socket."""
    if len(munge_key) < 32:
        raise ValueError("a munge key needs at least 32 bytes")
    await _ensure_dirs(shell, cfg.munge_directories(spec))
    changed = await shell.write_file(spec.paths.munge_key, munge_key, mode=0o400, owner="munge")
    await _respawn_if(shell, cfg.MUNGED, cfg.munged_argv(spec), changed)
    await wait_for(
        lambda: _ok(shell, ["munge", "-n", f"--socket={spec.paths.munge_socket}"]),
        what=f"munged on {shell.hostname}",
        timeout_s=timeout_s,
    )


async def _write_text(
    shell: NodeShell, path: str, text: str, *, mode: int = 0o644, owner: str | None = None
) -> bool:
    return await shell.write_file(path, text.encode(), mode=mode, owner=owner)


async def _write_slurm_files(shell: NodeShell, spec: cfg.SlurmSpec, *, controller: bool) -> bool:
    """slurm.conf everywhere we write it; gres.conf and cgroup.conf on the controller
    only (configless mode serves them to slurmd). True when any file changed."""
    p = spec.paths
    changed = await _write_text(shell, p.slurm_conf, cfg.render_slurm_conf(spec))
    if controller:
        changed |= await _write_text(shell, p.gres_conf, cfg.render_gres_conf(spec))
        changed |= await _write_text(shell, p.cgroup_conf, cfg.render_cgroup_conf(spec))
        for path, text in cfg.controller_scripts(spec).items():
            changed |= await _write_text(shell, path, text, mode=0o755)
    return changed


def _node_records(conf: str) -> list[str]:
    return [line for line in conf.splitlines() if line.lower().startswith("nodename=")]


async def _nodes_change(shell: NodeShell, spec: cfg.SlurmSpec) -> bool:
    """Whether the slurm.conf about to be written defines other nodes than
    the one slurmctld runs with: Slurm 22.05 reads node records only at
    start (``scontrol reconfigure`` refuses a changed node list)."""
    old = await shell.read_file(spec.paths.slurm_conf)
    if old is None:
        return False
    return _node_records(old.decode()) != _node_records(cfg.render_slurm_conf(spec))


async def _write_scripts(shell: NodeShell, spec: cfg.SlurmSpec) -> bool:
    changed = False
    for path, text in cfg.scripts(spec).items():
        changed |= await _write_text(shell, path, text, mode=0o755)
    return changed


# --- controller -----------------------------------------------------------------------------


async def ping(shell: NodeShell) -> bool:
    """Whether slurmctld answers (from any node with a config and munge)."""
    result = await shell.run(["scontrol", "ping"], check=False, timeout_s=10.0)
    return result.returncode == 0 and " is UP" in result.stdout


async def wait_controller(shell: NodeShell, *, timeout_s: float = 30.0) -> None:
    async def probe() -> bool | None:
        return True if await ping(shell) else None

    await wait_for(probe, what=f"slurmctld seen from {shell.hostname}", timeout_s=timeout_s)


async def _start_accounting(shell: NodeShell, spec: cfg.SlurmSpec, *, timeout_s: float) -> None:
    p = spec.paths
    initialised = await shell.run(["test", "-d", f"{p.mysql_datadir}/mysql"], check=False)
    if initialised.returncode != 0:
        await shell.run(cfg.mariadb_install_argv(spec), timeout_s=120.0)
    await shell.spawn(cfg.MARIADBD, cfg.mariadbd_argv(spec))
    await wait_for(
        lambda: _ok(shell, cfg.mariadb_sql_argv(spec, "SELECT 1")),
        what="mariadbd",
        timeout_s=timeout_s,
    )
    await shell.run(cfg.mariadb_sql_argv(spec, cfg.MARIADB_BOOTSTRAP_SQL))
    dbd_changed = await _write_text(
        shell, p.slurmdbd_conf, cfg.render_slurmdbd_conf(spec), mode=0o600, owner="slurm"
    )
    await _respawn_if(shell, cfg.SLURMDBD, cfg.slurmdbd_argv(spec), dbd_changed)
    list_clusters = ["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"]

    async def clusters() -> list[str] | None:
        r = await shell.run(list_clusters, check=False, timeout_s=15.0)
        return r.stdout.split() if r.returncode == 0 else None

    known = await wait_for(clusters, what="slurmdbd", timeout_s=timeout_s)
    if spec.cluster_name not in known:
        await shell.run(["sacctmgr", "-i", "add", "cluster", spec.cluster_name])


async def start_controller(
    shell: NodeShell, spec: cfg.SlurmSpec, *, munge_key: bytes, timeout_s: float = 60.0
) -> None:
    """munged, accounting (MariaDB + slurmdbd) and slurmctld on the controller node;
    returns once slurmctld answers ``scontrol ping``. A running controller whose
    files changed is reconfigured in place."""
    await _ensure_dirs(shell, cfg.controller_directories(spec))
    await ensure_munge(shell, spec, munge_key=munge_key)
    restart = await _nodes_change(shell, spec)
    changed = await _write_slurm_files(shell, spec, controller=True)
    if spec.accounting:
        await _start_accounting(shell, spec, timeout_s=timeout_s)
    if restart:
        await shell.stop(cfg.SLURMCTLD, timeout_s=30.0)
    was_running = await shell.is_running(cfg.SLURMCTLD)
    await shell.spawn(cfg.SLURMCTLD, cfg.slurmctld_argv(spec))
    await wait_controller(shell, timeout_s=timeout_s)
    if was_running and changed:
        await reconfigure(shell)


async def stop_controller(shell: NodeShell) -> None:
    """Stop every daemon of the controller (state stays on the node); idempotent."""
    for name in (cfg.SLURMCTLD, cfg.SLURMDBD, cfg.MARIADBD, cfg.MUNGED):
        await shell.stop(name, timeout_s=30.0)


async def reconfigure(shell: NodeShell) -> None:
    """``scontrol reconfigure``: slurmctld rereads its files and pushes them to slurmd."""
    await shell.run(["scontrol", "reconfigure"], timeout_s=30.0)


async def apply_config(
    controller: NodeShell,
    spec: cfg.SlurmSpec,
    *,
    logins: Sequence[NodeShell] = (),
    computes: Sequence[NodeShell] = (),
) -> bool:
    """A saved Slurm configuration, live: files on the controller and login nodes,
    prolog/epilog on every compute node, then one reconfigure. True if anything
    changed. Settings Slurm reads only at daemon start (ports, plugin types) are
    ours and never change here."""
    changed = False
    for shell in computes:
        changed |= await _write_scripts(shell, spec)
    for shell in logins:
        changed |= await _write_slurm_files(shell, spec, controller=False)
    restart = await _nodes_change(controller, spec)
    changed |= await _write_slurm_files(controller, spec, controller=True)
    if restart:
        # Jobs survive: slurmctld saves its state, and slurmd keeps running them.
        await controller.stop(cfg.SLURMCTLD, timeout_s=30.0)
        await controller.spawn(cfg.SLURMCTLD, cfg.slurmctld_argv(spec))
        await wait_controller(controller)
    elif changed:
        await reconfigure(controller)
    return changed


# --- login and compute ------------------------------------------------------------------------


async def start_login(
    shell: NodeShell, spec: cfg.SlurmSpec, *, munge_key: bytes, timeout_s: float = 30.0
) -> None:
    """A login node: munged and a local slurm.conf (22.05 clients need one). Returns
    once slurmctld answers from this node, which proves key, config and network."""
    await ensure_munge(shell, spec, munge_key=munge_key)
    await _write_slurm_files(shell, spec, controller=False)
    await wait_controller(shell, timeout_s=timeout_s)


async def _node_clock(shell: NodeShell) -> int:
    return int((await shell.run(["date", "+%s"])).stdout.strip())


async def join_compute(
    controller: NodeShell,
    node: NodeShell,
    spec: cfg.SlurmSpec,
    *,
    munge_key: bytes,
    features: Iterable[str] = (),
    slot: str | None = None,
    timeout_s: float = 30.0,
) -> SlurmNode:
    """munged, prolog/epilog and ``slurmd -Z`` on a GPU node; returns the node once
    slurmctld lists it as responding with the slurmd we started (or found running).

    A slurmd that runs but is unknown to slurmctld (the node was deleted with
    ``scontrol delete``; a dynamic slurmd registers only at start) is restarted.
    On a node that booted afresh, the jobs slurmctld still counts there are
    ended once slurmd is back (:func:`end_lost_jobs`).

    In an autoscaled cluster the node takes its ``slot`` (a ``State=CLOUD``
    node of slurm.conf). A slot Slurm has powered down and did not ask
    back (the cluster's first nodes, a node placed while Slurm thought the
    slot idle) is asked to power up first: a powered-down node that simply
    registers is one Slurm did not expect."""
    name = slot or node.hostname
    await _ensure_dirs(node, cfg.compute_directories(spec))
    await ensure_munge(node, spec, munge_key=munge_key)
    await _write_scripts(node, spec)
    argv = cfg.slurmd_argv(spec, node_name=node.hostname, features=features, slot=slot)
    if slot is not None:
        current = await get_node(controller, slot)
        if current is not None and current.powered_down and not current.powering_up:
            await _scontrol_update(controller, slot, "state=power_up")
    not_before = 0
    booted = False
    if await node.is_running(cfg.SLURMD):
        current = await get_node(controller, name)
        if current is None or not current.responding:
            await node.stop(cfg.SLURMD)
    if not await node.is_running(cfg.SLURMD):
        # No slurmd and no job step either: the node's processes all went
        # (a reboot, a lost instance rebuilt), not slurmd alone.
        stepd = await node.run(["pgrep", "-x", "slurmstepd"], check=False)
        booted = stepd.returncode != 0
        not_before = await _node_clock(node)
        await node.spawn(cfg.SLURMD, argv)

    async def registered() -> SlurmNode | None:
        n = await get_node(controller, name)
        if n is None or not n.responding or n.slurmd_start_time < not_before:
            return None
        return n

    if slot is None:
        found = await wait_for(
            registered, what=f"slurmd on {name} to register", timeout_s=timeout_s
        )
    else:
        found = await _wait_slot_registered(
            controller, node, argv, slot, registered, timeout_s=timeout_s
        )
    if booted:
        # A slot's jobs that wait for it to power up (CONFIGURING) are
        # what it was asked for, not lost.
        await end_lost_jobs(controller, name, waiting_ok=slot is not None)
    return found


# How long a slot's slurmd may go unregistered before it starts again.
SLOT_BOOT_RETRY_S = 4.0


async def _wait_slot_registered(
    controller: NodeShell,
    node: NodeShell,
    argv: list[str],
    slot: str,
    registered: Callable[[], Awaitable[SlurmNode | None]],
    *,
    timeout_s: float,
) -> SlurmNode:
    """slurmctld accepts a powering-up slot's registration only from a boot
    after its power-up request, to the second; a slurmd started in the
    same second as the request (a node placed the moment Slurm asked)
    reports a boot just before it and is ignored ("still waiting for
    boot"). Such a slurmd starts again, with a later boot."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        left = deadline - loop.time()
        found = await poll_until(registered, timeout_s=max(0.0, min(SLOT_BOOT_RETRY_S, left)))
        if found is not None:
            return found
        if loop.time() >= deadline:
            raise LayerError(
                f"timed out after {timeout_s:.0f} s waiting for slurmd on {slot} to register"
            )
        current = await get_node(controller, slot)
        if current is not None and current.powering_up and not current.responding:
            log.info("slurmd for %s is not taken for a fresh boot: starting it again", slot)
            await node.stop(cfg.SLURMD)
            await node.spawn(cfg.SLURMD, argv)


async def end_lost_jobs(controller: NodeShell, name: str, *, waiting_ok: bool = False) -> list[int]:
    """End the jobs slurmctld still counts on ``name`` after the node booted
    afresh; returns their ids. Slurm cannot tell by itself: a node shares
    its host's kernel, so its boot time did not change, and an interactive
    allocation whose ``srun`` died with the login node is never reported
    gone (``InactiveLimit`` is unset), so the job would hold the node, and
    a drain or a delete would wait, for ever. Batch jobs are requeued
    (``JobRequeue=1``: they run again from their start, or their own
    checkpoint), the others cancelled; a job on several nodes goes whole,
    as its part here is dead."""
    lost = [
        j
        for j in active_jobs_on(await list_jobs(controller), name)
        if not (waiting_ok and j.state == "CONFIGURING")
    ]
    for job in lost:
        r = await controller.run(["scontrol", "requeue", str(job.job_id)], check=False)
        if r.returncode != 0:
            await controller.run(["scancel", str(job.job_id)], check=False)
    if lost:
        log.info("node %s booted afresh: ended its lost jobs %s", name, [j.job_id for j in lost])
    return [j.job_id for j in lost]


# --- queries ----------------------------------------------------------------------------------


async def list_nodes(shell: NodeShell) -> list[SlurmNode]:
    return parse_sinfo_json((await shell.run(["sinfo", "--json"], timeout_s=30.0)).stdout)


async def get_node(shell: NodeShell, name: str) -> SlurmNode | None:
    # sinfo --json ignores -n in 22.05: filter here.
    return next((n for n in await list_nodes(shell) if n.name == name), None)


async def list_jobs(shell: NodeShell) -> list[SlurmJob]:
    return parse_squeue_json((await shell.run(["squeue", "--json"], timeout_s=30.0)).stdout)


async def accounted_jobs(shell: NodeShell, job_ids: Iterable[int] = ()) -> list[AccountedJob]:
    argv = ["sacct", "--json", "--allusers"]
    ids = ",".join(str(i) for i in job_ids)
    if ids:
        argv += ["-j", ids]
    return parse_sacct_json((await shell.run(argv, timeout_s=30.0)).stdout)


async def run_as_job(
    controller: NodeShell,
    node: NodeShell,
    node_name: str,
    argv: Sequence[str],
    *,
    timeout_s: float,
    queue_wait_s: float = 3600.0,
    job_name: str = "gpuclusters-check",
) -> CommandResult:
    """Run ``argv`` on ``node_name`` as an exclusive Slurm batch job with all
    its GPUs (as root, from the controller) and wait for it: it starts once
    users' jobs have left the node and nothing lands beside it. The job's
    output (written on the node) is the result's stdout. ``timeout_s`` is
    the job's time limit; a job that cannot start within ``queue_wait_s``
    (the node stayed busy) ends by its deadline, non-zero and without
    output."""
    wrap = " ".join(shlex.quote(a) for a in argv)
    out_file = "/tmp/gpuclusters-job-%j.out"
    limit_min = max(1, math.ceil(timeout_s / 60))
    # Slurm refuses a job whose time limit ends past its deadline, so the
    # deadline leaves room for the whole limit after the longest wait.
    deadline_s = int(limit_min * 60 + queue_wait_s)
    r = await controller.run(
        [
            "sbatch",
            "--parsable",
            "--wait",
            "--exclusive",
            f"--nodelist={node_name}",
            "--nodes=1",
            f"--gres=gpu:{GPUS_PER_NODE}",
            f"--job-name={job_name}",
            f"--output={out_file}",
            f"--time={limit_min}",
            f"--deadline=now+{deadline_s}seconds",
            "--wrap",
            wrap,
        ],
        check=False,
        timeout_s=deadline_s + 60.0,
    )
    job_id = r.stdout.strip().splitlines()[0].split(";")[0] if r.stdout.strip() else ""
    output = b""
    if job_id.isdigit():
        path = out_file.replace("%j", job_id)
        output = await node.read_file(path) or b""
        await node.run(["rm", "-f", path], check=False)
    return CommandResult(
        returncode=r.returncode, stdout=output.decode(errors="replace"), stderr=r.stderr
    )


# --- cordon, drain, remove --------------------------------------------------------------------


def _check_reason(reason: str) -> str:
    text = f"{REASON_PREFIX} {reason}".strip()
    if "\n" in text or len(text) > 200:
        raise ValueError("a drain reason is one line of at most 200 characters")
    return text


async def _scontrol_update(shell: NodeShell, name: str, *args: str) -> CommandResult:
    return await shell.run(
        ["scontrol", "update", f"nodename={name}", *args], check=False, timeout_s=30.0
    )


async def cordon(shell: NodeShell, name: str, *, reason: str) -> bool:
    """Drain ``name`` (no new jobs; running ones continue). A node already drained
    keeps the reason it has. False if Slurm does not know the node."""
    node = await get_node(shell, name)
    if node is None:
        return False
    if not node.drain:
        r = await _scontrol_update(shell, name, "state=drain", f"reason={_check_reason(reason)}")
        if r.returncode != 0:
            if "Invalid node name" in r.stderr:
                return False
            raise LayerError(f"scontrol drain {name}: {r.stderr.strip()}")
    return True


async def drain(shell: NodeShell, name: str, *, reason: str) -> bool:
    """Cordon, then answer whether the node is empty (no active job on it). Never
    blocks: the caller asks again until True or its deadline."""
    if not await cordon(shell, name, reason=reason):
        return True
    jobs = active_jobs_on(await list_jobs(shell), name)
    node = await get_node(shell, name)
    return not jobs and (node is None or not node.busy)


async def is_cordoned_by_user(shell: NodeShell, name: str) -> bool:
    """Drained by a user or admin (reason not ours): picked first at scale-down."""
    node = await get_node(shell, name)
    return node is not None and node.drain and not node.reason.startswith(REASON_PREFIX)


async def uncordon(shell: NodeShell, name: str) -> bool:
    """Resume a node *we* drained; a user's drain is left alone. True if resumed."""
    node = await get_node(shell, name)
    if node is None or not node.drain or not node.reason.startswith(REASON_PREFIX):
        return False
    r = await _scontrol_update(shell, name, "state=resume")
    if r.returncode != 0:
        raise LayerError(f"scontrol resume {name}: {r.stderr.strip()}")
    return True


async def remove(controller: NodeShell, name: str, *, node: NodeShell | None = None) -> None:
    """Stop slurmd (when the node is still reachable) and delete the dynamic node
    from slurmctld. A node Slurm does not know is not an error; one with jobs is
    refused by Slurm ("Requested nodes are busy") and raises ``LayerError``:
    drain first."""
    if node is not None:
        await node.stop(cfg.SLURMD, timeout_s=30.0)
    r = await controller.run(["scontrol", "delete", f"nodename={name}"], check=False)
    if r.returncode == 0:
        return
    err = (r.stderr or r.stdout).strip()
    if "Invalid node name" in err:
        return
    raise LayerError(f"scontrol delete {name}: {err}")


async def release_slot(controller: NodeShell, slot: str, *, node: NodeShell | None = None) -> None:
    """An autoscaled cluster's node goes: its slot stays in slurm.conf,
    powered down (ready to be asked for again) and without the drain we
    set while it emptied. A slot Slurm powers down already is left to it;
    any other (a repair, a cluster delete) is powered down by force."""
    if node is not None:
        await node.stop(cfg.SLURMD, timeout_s=30.0)
    current = await get_node(controller, slot)
    if current is None:
        return
    if current.drain:
        await _scontrol_update(controller, slot, "state=undrain")
    if not (current.powered_down or current.powering_down):
        await _scontrol_update(controller, slot, "state=power_down_force")


async def ensure_admins(controller: NodeShell, names: Iterable[str]) -> list[str]:
    """Give these users AdminLevel=Admin in the cluster's accounting (so they
    may drain nodes, e.g. to pick them for a targeted scale-down); returns
    the names changed. Needs accounting (slurmdbd) up."""
    changed = []
    for name in names:
        r = await controller.run(
            ["sacctmgr", "-n", "-P", "show", "user", name, "format=adminlevel"], check=False
        )
        if r.stdout.strip() == "Administrator":
            continue
        if not r.stdout.strip():
            await controller.run(
                ["sacctmgr", "-i", "add", "user", name, "account=root", "adminlevel=Admin"]
            )
        else:
            await controller.run(
                ["sacctmgr", "-i", "modify", "user", name, "set", "adminlevel=Admin"]
            )
        changed.append(name)
    return changed
