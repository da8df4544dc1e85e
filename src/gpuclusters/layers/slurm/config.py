"""Slurm configuration, rendered as text and argv lists; pure, no I/O.

Everything the Slurm layer writes into nodes or runs there comes from here, so
what was proved by hand (``scripts/setup-slurm-proto``, Debian's Slurm 22.05)
stays in one place and is unit-tested.

The shape of a cluster (one per gpuclusters cluster, nothing shared between
clusters except the host kernel):

- **controller** service node: ``munged`` (the cluster's own key), ``mariadbd``
  (unix socket only, datadir on the controller), ``slurmdbd``, ``slurmctld``
  in *configless* mode (``SlurmctldParameters=enable_configless``). It holds
  the only copies of slurm.conf, gres.conf and cgroup.conf that Slurm reads.
- **compute** nodes: ``munged`` and ``slurmd -Z`` (dynamic registration,
  ``--conf-server`` = controller) with ``Gres=gpu:N`` and features on the
  command line; no node list in slurm.conf. slurmd fetches the config from
  slurmctld and caches it (``/run/slurm/conf`` -> spool), so client commands
  also work on compute nodes.
- **login** node: ``munged`` and a local copy of slurm.conf (22.05 has no
  ``sackd``; a client needs a slurm.conf or a running slurmd). We are the
  only writer of slurm.conf, so keeping the copy equal is easy.

Decisions the prototype settled:

- ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: nodes
  share the host's cgroup v1 hierarchy, where two slurmd (of two clusters,
  whose job ids collide) would fight over ``/slurm/uid_*/job_*``. cgroup.conf
  still says ``CgroupPlugin=cgroup/v1`` (autodetect picks v2 on hybrid hosts
  and slurmd fails). Revisit when nodes get their own cgroup namespace.
- ``SchedulerParameters`` always carries ``nohold_on_prolog_fail``: without it
  a job whose prolog fails is requeued *held* (reason "launch failed requeued
  held"); the contract wants it requeued. Slurm still delays a requeued job
  by the credential lifetime (``cred_expire``, default 120 s).
- Every daemon runs in the foreground (``-D``/``-F``) and logs to stderr,
  which the node shell appends to ``/var/log/gpuclusters/<name>.log``.
- The munge socket is named explicitly everywhere (``AuthInfo``,
  ``AccountingStoragePass``, slurmdbd's ``AuthInfo``): a provider that cannot
  give every node a private ``/run`` can then move it per cluster.

Users may add slurm.conf, gres.conf and cgroup.conf lines. Keys that we own
(identity, auth, ports, paths, plugins that must match the node layout) are
refused with a ``ValidationError`` naming the key; keys for which we only set
a default (KillWait, MaxArraySize, JobRequeue, ...) are replaced by the
user's line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuclusters.core.errors import ValidationError

MANAGED_HEADER = "# Managed by gpuclusters: edit through the cluster's Slurm settings.\n"

SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
SLURMDBD_PORT = 6819
DEFAULT_PARTITION = "gpu"
GPU_NODE_FEATURE = "gpu"
NODESET = "gpunodes"
DEFAULT_GPU_DEVICES: tuple[str, ...] = tuple(f"/dev/nvidia{i}" for i in range(8))

# Daemon names given to NodeShell.spawn (their logs are /var/log/gpuclusters/<name>.log).
MUNGED = "munged"
MARIADBD = "mariadbd"
SLURMDBD = "slurmdbd"
SLURMCTLD = "slurmctld"
SLURMD = "slurmd"


@dataclass(frozen=True, slots=True)
class SlurmPaths:
    """Paths inside nodes. Defaults are Debian's, in node-private directories."""

    conf_dir: str = "/etc/slurm"
    munge_key: str = "/etc/munge/munge.key"
    munge_socket: str = "/run/munge/munge.socket.2"
    munge_run_dir: str = "/run/munge"
    munge_lib_dir: str = "/var/lib/munge"
    munge_log_dir: str = "/var/log/munge"
    state_dir: str = "/var/spool/slurmctld"
    slurmd_spool: str = "/var/spool/slurmd"
    run_dir: str = "/run/slurm"
    # Not /var/lib/mysql: a node's /var sits over the host's, where Debian keeps
    # its own datadir; every cluster gets a fresh database of its own here.
    mysql_datadir: str = "/var/lib/gpuclusters/mysql"
    mysql_run_dir: str = "/run/mysqld"
    prolog: str = "/etc/slurm/prolog.sh"
    epilog: str = "/etc/slurm/epilog.sh"
    resume_program: str = "/etc/slurm/resume.sh"
    suspend_program: str = "/etc/slurm/suspend.sh"
    # Written by slurmctld's user (the programs run as SlurmUser).
    power_log: str = "/var/spool/slurmctld/power.log"

    @property
    def slurm_conf(self) -> str:
        return f"{self.conf_dir}/slurm.conf"

    @property
    def gres_conf(self) -> str:
        return f"{self.conf_dir}/gres.conf"

    @property
    def cgroup_conf(self) -> str:
        return f"{self.conf_dir}/cgroup.conf"

    @property
    def slurmdbd_conf(self) -> str:
        return f"{self.conf_dir}/slurmdbd.conf"

    @property
    def mysql_socket(self) -> str:
        return f"{self.mysql_run_dir}/mysqld.sock"


@dataclass(frozen=True, slots=True)
class CloudNodes:
    """An autoscaled cluster's slots (core/autoscale.py) as Slurm power
    saving sees them: ``State=CLOUD`` nodes, powered up when work waits
    (ResumeProgram) and down after ``suspend_time_s`` idle
    (SuspendProgram), ``keep`` of them never powered down (min_gpus)."""

    names: tuple[str, ...]
    keep: int = 0
    suspend_time_s: int = 600
    # How long a node has to register after Slurm asked for it (a node
    # boots in seconds here; a host's capacity may take longer to free).
    resume_timeout_s: int = 600
    suspend_timeout_s: int = 30
    features: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SlurmSpec:
    """What a cluster's Slurm configuration is made from."""

    cluster_name: str
    controller_host: str
    controller_addr: str
    partition: str = DEFAULT_PARTITION
    gpus_per_node: int = 8
    gpu_type: str | None = None
    gpu_devices: tuple[str, ...] = DEFAULT_GPU_DEVICES
    max_nodes: int = 1024
    prolog_script: str | None = None
    epilog_script: str | None = None
    accounting: bool = True
    extra_slurm_conf: str = ""
    extra_gres_conf: str = ""
    extra_cgroup_conf: str = ""
    cloud: CloudNodes | None = None
    paths: SlurmPaths = field(default_factory=SlurmPaths)

    def __post_init__(self) -> None:
        validate_spec(self)


@dataclass(frozen=True, slots=True)
class Directory:
    """A directory a daemon needs, with the owner it insists on."""

    path: str
    owner: str
    mode: int


# --- validation ---------------------------------------------------------------------------

_CLUSTER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_FEATURE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# slurm.conf keys we own: changing them breaks the node layout, auth or identity.
OWNED_SLURM_KEYS: frozenset[str] = frozenset(
    k.lower()
    for k in (
        "ClusterName",
        "SlurmctldHost",
        "ControlMachine",
        "ControlAddr",
        "BackupController",
        "BackupAddr",
        "SlurmctldParameters",
        "AuthType",
        "AuthInfo",
        "AuthAltTypes",
        "AuthAltParameters",
        "CredType",
        "SlurmUser",
        "SlurmdUser",
        "SlurmctldPort",
        "SlurmdPort",
        "StateSaveLocation",
        "SlurmdSpoolDir",
        "SlurmctldPidFile",
        "SlurmdPidFile",
        "SlurmctldLogFile",
        "SlurmdLogFile",
        "SlurmSchedLogFile",
        "PluginDir",
        "PlugStackConfig",
        "Include",
        "ProctrackType",
        "TaskPlugin",
        "PrologFlags",
        "SelectType",
        "GresTypes",
        "MaxNodeCount",
        "TreeWidth",
        "Prolog",
        "Epilog",
        "AccountingStorageType",
        "AccountingStorageHost",
        "AccountingStorageBackupHost",
        "AccountingStoragePort",
        "AccountingStoragePass",
        "AccountingStorageUser",
        "AccountingStorageExternalHost",
        "JobCompType",
        "JobCompLoc",
        "JobCompHost",
        "JobCompPass",
        "JobCompPort",
        "JobCompUser",
        "NodeName",
        "DownNodes",
        "FrontendName",
        "CommunicationParameters",
        "SlurmctldAddr",
        # Power saving drives autoscaling (docs/autoscaling.md).
        "SuspendProgram",
        "ResumeProgram",
        "SuspendTime",
        "SuspendTimeout",
        "ResumeTimeout",
        "SuspendExcNodes",
        "SuspendExcParts",
        "ResumeFailProgram",
    )
)
# Lines whose first key opens a record; later keys on the line are its options.
_RECORD_KEYS = frozenset({"partitionname", "nodeset", "nodename", "downnodes", "frontendname"})

# Settings we only default; a user line replaces ours.
DEFAULT_SLURM_SETTINGS: tuple[tuple[str, str], ...] = (
    ("SelectTypeParameters", "CR_Core"),
    ("MpiDefault", "none"),
    ("ReturnToService", "2"),
    ("KillWait", "30"),
    ("MaxArraySize", "1000"),
    ("JobRequeue", "1"),
    ("MailProg", "/bin/true"),
    ("JobAcctGatherType", "jobacct_gather/linux"),
    ("AccountingStorageTRES", "gres/gpu"),
)
# SchedulerParameters: the user's options are kept, ours are added.
REQUIRED_SCHEDULER_PARAMETERS: tuple[str, ...] = ("nohold_on_prolog_fail",)

OWNED_CGROUP_KEYS: frozenset[str] = frozenset({"cgroupplugin", "cgroupmountpoint"})
DEFAULT_CGROUP_SETTINGS: tuple[tuple[str, str], ...] = (
    ("ConstrainCores", "no"),
    ("ConstrainRAMSpace", "no"),
    ("ConstrainDevices", "no"),
)


def slurm_cluster_name(name: str) -> str:
    """A valid ClusterName for a gpuclusters cluster name (lower case, ``_`` for others)."""
    out = re.sub(r"[^a-z0-9_]", "_", name.lower())[:40]
    if not out or not out[0].isalpha():
        out = ("c" + out)[:40]
    return out


def hostlist(names: Sequence[str]) -> str:
    """``a-as1, a-as2, a-as3`` -> ``a-as[1-3]`` (names of one prefix and
    consecutive numbers; others are listed with commas)."""
    parsed = [re.match(r"^(.*?)(\d+)$", n) for n in names]
    if len(names) > 1 and all(parsed):
        prefixes = {m.group(1) for m in parsed if m}
        numbers = [int(m.group(2)) for m in parsed if m]
        if len(prefixes) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{prefixes.pop()}[{numbers[0]}-{numbers[-1]}]"
    return ",".join(names)


def power_program(spec: SlurmSpec, action: str) -> str:
    """Slurm's ResumeProgram or SuspendProgram for an autoscaled cluster.
    It only records the call: the control plane reads the power state
    Slurm keeps for each slot (``sinfo``) at every pass and adds or
    releases nodes to match, so a call made while the server is down is
    not lost."""
    return (
        "#!/bin/sh\n"
        "# Managed by gpuclusters: Slurm power saving drives autoscaling; the control\n"
        "# plane follows the nodes' power state (docs/autoscaling.md).\n"
        f'echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) {action} $*" >> {spec.paths.power_log}\n'
    )


def controller_scripts(spec: SlurmSpec) -> dict[str, str]:
    """Programs slurmctld runs on the controller: path -> content."""
    if spec.cloud is None:
        return {}
    return {
        spec.paths.resume_program: power_program(spec, "resume"),
        spec.paths.suspend_program: power_program(spec, "suspend"),
    }


def scripts(spec: SlurmSpec) -> dict[str, str]:
    """Prolog/epilog files every compute node needs (22.05's configless mode does not
    ship them): path -> content."""
    out: dict[str, str] = {}
    if spec.prolog_script is not None:
        out[spec.paths.prolog] = spec.prolog_script
    if spec.epilog_script is not None:
        out[spec.paths.epilog] = spec.epilog_script
    return out


def validate_spec(spec: SlurmSpec) -> None:
    """Raise ``ValidationError`` for a spec that cannot be rendered."""
    if not _CLUSTER_NAME.match(spec.cluster_name):
        raise ValidationError(
            "Slurm cluster names are 1-40 lowercase letters, digits or '_', starting with a"
            f" letter (they name accounting tables): {spec.cluster_name!r}",
            field="cluster_name",
        )
    if not _NAME.match(spec.controller_host):
        raise ValidationError(
            f"invalid controller hostname {spec.controller_host!r}", field="controller_host"
        )
    if not re.match(r"^[0-9A-Fa-f:.]+$", spec.controller_addr):
        raise ValidationError(
            f"controller address must be an IP address: {spec.controller_addr!r}",
            field="controller_addr",
        )
    if not _NAME.match(spec.partition):
        raise ValidationError(f"invalid partition name {spec.partition!r}", field="partition")
    if spec.gpus_per_node < 0 or spec.gpus_per_node != len(spec.gpu_devices):
        raise ValidationError(
            f"gpus_per_node ({spec.gpus_per_node}) must equal the number of GPU device"
            f" paths ({len(spec.gpu_devices)})",
            field="gpu_devices",
        )
    for dev in spec.gpu_devices:
        if not re.match(r"^/dev/[A-Za-z0-9_/.-]+$", dev):
            raise ValidationError(f"invalid GPU device path {dev!r}", field="gpu_devices")
    if spec.gpu_type is not None and not _FEATURE.match(spec.gpu_type):
        raise ValidationError(f"invalid GPU type {spec.gpu_type!r}", field="gpu_type")
    if spec.accounting and spec.paths.mysql_socket != "/run/mysqld/mysqld.sock":
        raise ValidationError(
            "MariaDB's socket must be /run/mysqld/mysqld.sock: slurmdbd reaches it as"
            " StorageHost=localhost and cannot name another",
            field="paths",
        )
    for fld, script in (("prolog", spec.prolog_script), ("epilog", spec.epilog_script)):
        # slurmd execs the script directly: without "#!" every job fails and drains nodes.
        if script is not None and not script.startswith("#!"):
            raise ValidationError(
                f"the {fld} script must start with an interpreter line such as #!/bin/sh",
                field=fld,
            )
    if spec.max_nodes < 1:
        raise ValidationError("max_nodes must be at least 1", field="max_nodes")
    _user_slurm_lines(spec.extra_slurm_conf, partition=spec.partition)
    _user_simple_lines(
        spec.extra_cgroup_conf,
        owned=OWNED_CGROUP_KEYS,
        what="cgroup.conf",
        field="cgroup_conf",
    )
    _user_gres_lines(spec.extra_gres_conf)


def _logical_lines(text: str) -> list[str]:
    """Lines without comments and blanks, with backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            out.append(line)
    if pending.strip():
        out.append(pending.strip())
    return out


def _pairs(line: str, *, what: str, field: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for token in _split_tokens(line):
        key, sep, value = token.partition("=")
        if not sep or not key or not re.match(r"^[A-Za-z][A-Za-z0-9_]*$", key):
            raise ValidationError(
                f"{what}: expected Key=Value, got {token!r} in line {line!r}", field=field
            )
        pairs.append((key, value))
    return pairs


def _split_tokens(line: str) -> list[str]:
    """Split on whitespace outside double quotes (slurm.conf quoting)."""
    tokens: list[str] = []
    cur = ""
    quoted = False
    for ch in line:
        if ch == '"':
            quoted = not quoted
            cur += ch
        elif ch.isspace() and not quoted:
            if cur:
                tokens.append(cur)
            cur = ""
        else:
            cur += ch
    if quoted:
        raise ValidationError(f"unbalanced quote in line {line!r}", field="slurm_conf")
    if cur:
        tokens.append(cur)
    return tokens


@dataclass(frozen=True, slots=True)
class _UserSlurmConf:
    settings: dict[str, str]  # lower-case key -> line as given
    records: list[str]  # PartitionName=..., NodeSet=... lines
    scheduler_parameters: list[str]


def _user_slurm_lines(text: str, *, partition: str) -> _UserSlurmConf:
    settings: dict[str, str] = {}
    records: list[str] = []
    sched: list[str] = []
    for line in _logical_lines(text):
        pairs = _pairs(line, what="slurm.conf", field="slurm_conf")
        first = pairs[0][0].lower()
        if first in _RECORD_KEYS:
            if first in OWNED_SLURM_KEYS:
                raise ValidationError(
                    f"slurm.conf: {pairs[0][0]} is managed by gpuclusters (nodes register"
                    " themselves); use partitions over the node set instead",
                    field="slurm_conf",
                )
            name = pairs[0][1]
            if first == "partitionname" and name.lower() == partition.lower():
                raise ValidationError(
                    f"slurm.conf: partition {name!r} is managed by gpuclusters; add another",
                    field="slurm_conf",
                )
            if first == "nodeset" and name.lower() == NODESET:
                raise ValidationError(
                    f"slurm.conf: NodeSet {name!r} is managed by gpuclusters",
                    field="slurm_conf",
                )
            records.append(" ".join(f"{k}={v}" for k, v in pairs))
            continue
        for key, value in pairs:
            low = key.lower()
            if low in OWNED_SLURM_KEYS:
                raise ValidationError(
                    f"slurm.conf: {key} is managed by gpuclusters and cannot be set",
                    field="slurm_conf",
                )
            if low == "schedulerparameters":
                sched.extend(p for p in value.split(",") if p)
                continue
            if low in settings:
                raise ValidationError(f"slurm.conf: {key} is set twice", field="slurm_conf")
            settings[low] = f"{key}={value}"
    return _UserSlurmConf(settings=settings, records=records, scheduler_parameters=sched)


def _user_simple_lines(
    text: str, *, owned: frozenset[str], what: str, field: str
) -> dict[str, str]:
    settings: dict[str, str] = {}
    for line in _logical_lines(text):
        for key, value in _pairs(line, what=what, field=field):
            if key.lower() in owned:
                raise ValidationError(
                    f"{what}: {key} is managed by gpuclusters and cannot be set", field=field
                )
            if key.lower() in settings:
                raise ValidationError(f"{what}: {key} is set twice", field=field)
            settings[key.lower()] = f"{key}={value}"
    return settings


def _user_gres_lines(text: str) -> list[str]:
    lines: list[str] = []
    for line in _logical_lines(text):
        pairs = _pairs(line, what="gres.conf", field="gres_conf")
        for key, value in pairs:
            if key.lower() == "name" and value.lower() == "gpu":
                raise ValidationError(
                    "gres.conf: Name=gpu is managed by gpuclusters (the node's GPU devices)",
                    field="gres_conf",
                )
        lines.append(" ".join(f"{k}={v}" for k, v in pairs))
    return lines


# --- rendering ----------------------------------------------------------------------------


def _munge_auth_info(spec: SlurmSpec) -> str:
    return f"socket={spec.paths.munge_socket}"


def render_slurm_conf(spec: SlurmSpec) -> str:
    """slurm.conf: served to slurmd by slurmctld (configless), copied to login nodes."""
    p = spec.paths
    user = _user_slurm_lines(spec.extra_slurm_conf, partition=spec.partition)
    lines = [
        f"ClusterName={spec.cluster_name}",
        f"SlurmctldHost={spec.controller_host}({spec.controller_addr})",
        # cloud_reg_addrs: a slot learns its node's address when it registers.
        "SlurmctldParameters=enable_configless"
        + (",cloud_reg_addrs" if spec.cloud is not None else ""),
        "AuthType=auth/munge",
        f"AuthInfo={_munge_auth_info(spec)}",
        "CredType=cred/munge",
        "SlurmUser=slurm",
        "SlurmdUser=root",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        f"StateSaveLocation={p.state_dir}",
        f"SlurmdSpoolDir={p.slurmd_spool}",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        # An "extern" step on every node of a job at allocation: what
        # pam_slurm_adopt looks for to let the job's user ssh to the node
        # (docs/access.md).
        "PrologFlags=Contain",
        "SelectType=select/cons_tres",
        "GresTypes=gpu",
        f"MaxNodeCount={spec.max_nodes}",
        # Dynamic nodes cannot be used for hierarchical fan-out.
        "TreeWidth=65533",
    ]
    if spec.prolog_script is not None:
        lines.append(f"Prolog={p.prolog}")
    if spec.epilog_script is not None:
        lines.append(f"Epilog={p.epilog}")
    if spec.accounting:
        lines += [
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStorageHost={spec.controller_addr}",
            f"AccountingStoragePort={SLURMDBD_PORT}",
            # With auth/munge this names the munge socket slurmctld uses for slurmdbd.
            f"AccountingStoragePass={p.munge_socket}",
        ]
    else:
        lines.append("AccountingStorageType=accounting_storage/none")
    lines.append("JobCompType=jobcomp/none")
    for key, value in DEFAULT_SLURM_SETTINGS:
        if key == "AccountingStorageTRES" and not spec.accounting:
            continue
        lines.append(user.settings.pop(key.lower(), f"{key}={value}"))
    sched = list(dict.fromkeys([*user.scheduler_parameters, *REQUIRED_SCHEDULER_PARAMETERS]))
    lines.append(f"SchedulerParameters={','.join(sched)}")
    lines += user.settings.values()
    lines += _power_saving_lines(spec, user_private_data="privatedata" in user.settings)
    lines += [
        f"NodeSet={NODESET} Feature={GPU_NODE_FEATURE}",
        f"PartitionName={spec.partition} Nodes={NODESET} Default=YES MaxTime=INFINITE State=UP",
        *user.records,
    ]
    return MANAGED_HEADER + "\n".join(lines) + "\n"


def _power_saving_lines(spec: SlurmSpec, *, user_private_data: bool) -> list[str]:
    cloud = spec.cloud
    if cloud is None or not cloud.names:
        return []
    p = spec.paths
    nodes = hostlist(cloud.names)
    node_line = [f"NodeName={nodes}", "State=CLOUD"]
    gres = node_gres(spec)
    if gres:
        node_line.append(f"Gres={gres}")
    node_line.append(f"Feature={','.join(node_features(spec, cloud.features))}")
    lines = [
        f"ResumeProgram={p.resume_program}",
        f"SuspendProgram={p.suspend_program}",
        f"SuspendTime={cloud.suspend_time_s}",
        f"SuspendTimeout={cloud.suspend_timeout_s}",
        f"ResumeTimeout={cloud.resume_timeout_s}",
    ]
    if cloud.keep:
        lines.append(f"SuspendExcNodes={nodes}:{cloud.keep}")
    if not user_private_data:
        # Powered-down slots are listed too (sinfo shows them as idle~).
        lines.append("PrivateData=cloud")
    lines.append(" ".join(node_line))
    return lines


def compress_devices(devices: Sequence[str]) -> list[str]:
    """``/dev/nvidia0..7`` -> ``["/dev/nvidia[0-7]"]``; other lists stay one per entry."""
    parsed = [re.match(r"^(.*?)(\d+)$", d) for d in devices]
    if not devices or any(m is None for m in parsed):
        return list(devices)
    prefixes = {m.group(1) for m in parsed if m is not None}
    numbers = [int(m.group(2)) for m in parsed if m is not None]
    if len(prefixes) != 1 or len(devices) == 1:
        return list(devices)
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return list(devices)
    if any(m is not None and m.group(2) != str(int(m.group(2))) for m in parsed):
        return list(devices)  # zero-padded names do not survive a range
    return [f"{prefixes.pop()}[{numbers[0]}-{numbers[-1]}]"]


def render_gres_conf(spec: SlurmSpec) -> str:
    """gres.conf: one record for every node (dynamic nodes have no names up front).

    ``File=`` lines are required: without them slurmd counts 0 GPUs."""
    type_part = f" Type={spec.gpu_type}" if spec.gpu_type else ""
    lines = [f"Name=gpu{type_part} File={f}" for f in compress_devices(spec.gpu_devices)]
    lines += _user_gres_lines(spec.extra_gres_conf)
    return MANAGED_HEADER + "\n".join(lines) + "\n"


def render_cgroup_conf(spec: SlurmSpec) -> str:
    """cgroup.conf: the plugin is fixed to v1 (autodetect fails on hybrid hosts)."""
    user = _user_simple_lines(
        spec.extra_cgroup_conf,
        owned=OWNED_CGROUP_KEYS,
        what="cgroup.conf",
        field="cgroup_conf",
    )
    lines = ["CgroupPlugin=cgroup/v1"]
    for key, value in DEFAULT_CGROUP_SETTINGS:
        lines.append(user.pop(key.lower(), f"{key}={value}"))
    lines += user.values()
    return MANAGED_HEADER + "\n".join(lines) + "\n"


def render_slurmdbd_conf(spec: SlurmSpec) -> str:
    """slurmdbd.conf (mode 0600, owner slurm): MariaDB through its unix socket as the
    ``slurm`` database user authenticated by ``unix_socket`` (no password anywhere)."""
    lines = [
        "AuthType=auth/munge",
        f"AuthInfo={_munge_auth_info(spec)}",
        "DbdHost=localhost",
        f"DbdAddr={spec.controller_addr}",
        f"DbdPort={SLURMDBD_PORT}",
        "SlurmUser=slurm",
        "PidFile=/run/slurmdbd.pid",
        "StorageType=accounting_storage/mysql",
        "StorageHost=localhost",
        "StorageUser=slurm",
        # StorageHost=localhost: libmariadb uses its default socket, /run/mysqld/mysqld.sock
        "StorageLoc=slurm_acct_db",
    ]
    return MANAGED_HEADER + "\n".join(lines) + "\n"


MARIADB_BOOTSTRAP_SQL = """\
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket;
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
"""


# --- directories and argv -----------------------------------------------------------------


def munge_directories(spec: SlurmSpec) -> list[Directory]:
    p = spec.paths
    return [
        Directory(p.munge_run_dir, "munge", 0o755),
        Directory(p.munge_lib_dir, "munge", 0o700),
        Directory(p.munge_log_dir, "munge", 0o700),
    ]


def controller_directories(spec: SlurmSpec) -> list[Directory]:
    p = spec.paths
    dirs = [*munge_directories(spec), Directory(p.state_dir, "slurm", 0o755)]
    if spec.accounting:
        dirs += [
            Directory(p.mysql_datadir, "mysql", 0o750),
            Directory(p.mysql_run_dir, "mysql", 0o755),
        ]
    return dirs


def compute_directories(spec: SlurmSpec) -> list[Directory]:
    return [*munge_directories(spec), Directory(spec.paths.slurmd_spool, "root", 0o755)]


def mkdir_argv(d: Directory) -> list[str]:
    """``install -d`` is idempotent and fixes owner and mode of an existing directory."""
    return ["install", "-d", "-o", d.owner, "-g", d.owner, "-m", f"{d.mode:04o}", d.path]


def munged_argv(spec: SlurmSpec) -> list[str]:
    """munged has no run-as option: ``setpriv`` execs it as ``munge`` (no extra fork)."""
    p = spec.paths
    return [
        "setpriv",
        "--reuid=munge",
        "--regid=munge",
        "--init-groups",
        "munged",
        "--foreground",
        f"--key-file={p.munge_key}",
        f"--socket={p.munge_socket}",
        f"--pid-file={p.munge_run_dir}/munged.pid",
        f"--seed-file={p.munge_lib_dir}/munged.seed",
        f"--log-file={p.munge_log_dir}/munged.log",
    ]


def mariadb_install_argv(spec: SlurmSpec) -> list[str]:
    """Initialise the accounting datadir (once; ``mysql/`` inside it marks it done)."""
    return [
        "mariadb-install-db",
        "--no-defaults",
        "--user=mysql",
        f"--datadir={spec.paths.mysql_datadir}",
        "--auth-root-authentication-method=socket",
        "--skip-test-db",
    ]


def mariadbd_argv(spec: SlurmSpec) -> list[str]:
    p = spec.paths
    return [
        # --no-defaults: the host's /etc/mysql must not leak in; errors go to stderr.
        "mariadbd",
        "--no-defaults",
        "--user=mysql",
        f"--datadir={p.mysql_datadir}",
        f"--socket={p.mysql_socket}",
        f"--pid-file={p.mysql_run_dir}/mysqld.pid",
        "--skip-networking",
        "--innodb-buffer-pool-size=64M",
    ]


def mariadb_sql_argv(spec: SlurmSpec, sql: str) -> list[str]:
    return ["mariadb", "--no-defaults", f"--socket={spec.paths.mysql_socket}", "-e", sql]


def slurmdbd_argv(spec: SlurmSpec) -> list[str]:
    return ["slurmdbd", "-D"]


def slurmctld_argv(spec: SlurmSpec) -> list[str]:
    return ["slurmctld", "-D"]


def node_gres(spec: SlurmSpec) -> str:
    if spec.gpus_per_node == 0:
        return ""
    if spec.gpu_type:
        return f"gpu:{spec.gpu_type}:{spec.gpus_per_node}"
    return f"gpu:{spec.gpus_per_node}"


def node_features(spec: SlurmSpec, extra: Iterable[str] = ()) -> list[str]:
    feats = [GPU_NODE_FEATURE]
    if spec.gpu_type:
        feats.append(spec.gpu_type)
    for f in extra:
        if not _FEATURE.match(f):
            raise ValidationError(f"invalid node feature {f!r}", field="features")
        feats.append(f)
    return list(dict.fromkeys(feats))


def slurmd_argv(
    spec: SlurmSpec, *, node_name: str, features: Iterable[str] = (), slot: str | None = None
) -> list[str]:
    """``slurmd -Z``: a dynamic node that registers itself, with its GRES and features
    (the ``gpu`` feature puts it in the default partition's NodeSet). In an
    autoscaled cluster the node takes its slot instead: a ``State=CLOUD``
    node slurm.conf defines (GRES and features come from there)."""
    if not _NAME.match(node_name):
        raise ValidationError(f"invalid node name {node_name!r}", field="node_name")
    conf_server = f"{spec.controller_addr}:{SLURMCTLD_PORT}"
    if slot is not None:
        if not _NAME.match(slot):
            raise ValidationError(f"invalid slot name {slot!r}", field="slot")
        # A node shares its host's kernel, so its boot time predates Slurm's
        # power-up request, and slurmctld ignores a powering-up node's
        # registration until its boot time passes that request ("still
        # waiting for boot"). A time namespace whose boot clock starts now
        # gives slurmd the fresh boot of the node it stands for.
        return [
            "sh",
            "-c",
            # Less the whole seconds of uptime: a boot less than a second ago.
            'exec unshare --time --boottime "-$(cut -d. -f1 /proc/uptime)" '
            f"slurmd -D -N {slot} --conf-server {conf_server}",
        ]
    conf = [f"Feature={','.join(node_features(spec, features))}"]
    gres = node_gres(spec)
    if gres:
        conf.insert(0, f"Gres={gres}")
    return [
        "slurmd",
        "-D",
        "-Z",
        "-N",
        node_name,
        "--conf-server",
        conf_server,
        "--conf",
        " ".join(conf),
    ]


def validate_extra_slurm_conf(text: str, *, partition: str = DEFAULT_PARTITION) -> None:
    """Check user slurm.conf lines up front (the API calls this, so a bad line
    is refused when saved, not when the cluster reconfigures)."""
    try:
        _user_slurm_lines(text, partition=partition)
    except ValidationError as exc:
        raise ValidationError(
            f"slurm.extra_config: {exc.message}", field="slurm.extra_config"
        ) from None
