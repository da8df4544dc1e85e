"""Boot a node's filesystem: runs *inside* the node's fresh mount namespace.

Started by :mod:`gpuclusters.linux.machine` as::

    unshare --mount=<ns>/<id>.mnt --uts=<ns>/<id>.uts --ipc=<ns>/<id>.ipc \
        --propagation private -- python -I -S _nsinit.py < marshal.dumps(spec)

unshare(1) creates the mount, UTS and IPC namespaces and pins them with bind
mounts of their nsfs files *before* this script runs, so what the script
builds outlives it (and the server). The script then assembles the node's
root in ``spec.root`` (a per-node directory on the host) and pivots into it:

    /                 spec.root bound on itself (pivot_root needs a mount)
    /usr /opt /work…  every other top-level host dir, bound read-only
    /bin /lib…        the host's top-level symlinks, copied
    /etc /var         overlayfs: the host's /etc (with the node's own accounts
                      and the host's secrets whited out, linux/nodebase.py)
                      or a /var skeleton below, per-node upper above
    /run              fresh tmpfs; /run/gpuclusters the node's own (e.g. the
                      preemption notice); /run/gpuclusters/control = host's
                      run_dir (the control plane's agent socket)
    /tmp /scratch     per-node host dirs
    binds             per-node host dirs over paths in the /var overlay
                      (/var/lib/containerd, /var/lib/kubelet)
    /mnt/shared       the cluster's volume (if any)
    /root /home /mnt  plain dirs of spec.root (per node, survive reboot)
    /dev              tmpfs: null zero full random urandom tty kmsg bound
                      from the host, devpts newinstance, shm, and either
                      simulated nvidia* nodes (mknod) or, with
                      ``spec.devices``, the host's real GPU and InfiniBand
                      device nodes bound in (see :func:`expose_devices`)
    /proc /sys        proc of the node's PID namespace (mounted by its init);
                      sysfs mounted from the node's netns (so /sys/class/net
                      shows eth0), host cgroups bound under it
    masks             empty read-only tmpfs over host paths nodes must not
                      see (the control plane's home)
    shares            host paths the node needs at the same path (the Python
                      runtime the node agent runs with), bound read-only
    device mounts     with ``spec.devices``: driver files the node does not
                      already see (e.g. sockets under /run), bound read-only;
                      what was done is listed in /run/gpuclusters/devices

The old root is detached after pivot_root, which drops every reference this
namespace had to the host's other mounts (other nodes' pinned namespaces
among them), so deleting one node never waits on another.

Then the node gets its own **PID namespace**: this script unshares one and
forks the node's init, PID 1 there. The init mounts the node's /proc (a
proc shows the PID namespace of the process that mounts it), starts the
boot daemons, reports on a pipe and then only reaps orphans, for the life
of the node: a PID namespace whose init exits takes every process in it
along and admits no new one. This script prints ``init <host pid>`` and
exits; the caller pins the namespace (``/proc/<pid>/ns/pid``: unshare(1)
cannot pin a PID namespace that has no process yet) and records the pid.
Every process of a node, daemon or command, is then in that namespace:
``ps -e`` in a node shows the node's processes only, and powering the node
off is one SIGKILL to its init.

**In a user namespace** (the default; ``spec["userns"]`` names the node's
pinned user namespace, made by :mod:`gpuclusters.linux.userns`, which also
owns the node's netns) the script is started directly by the caller, not
through unshare(1), and :func:`boot_in_userns` does the namespaces itself:
a child in the user namespace makes the mount, UTS, IPC and cgroup
namespaces (so the node's root owns them, and the cgroup namespace is
rooted at the node's delegated cgroup); this process, still host root,
joins them and builds the root as above, except that every host directory
the node shares (the top-level binds, the /etc and /var lower layers, the
shares) is an *idmapped* mount (open_tree + mount_setattr) onto the node's
id block, so host files keep their owners as the node sees them and stay
unwritable to it; the cgroup hierarchies are mounted from inside the cgroup
namespace. Last it enters the user namespace and forks the init into a PID
namespace that the user namespace owns. The init mounts /proc before the
pivot (the kernel lets a user namespace mount a proc only where one is
already fully visible) and stays dumpable, so a ``hostPID`` pod's
``nsenter -t 1`` can enter it.

Run with ``-I -S``; its start-up time is most of a node's creation time, so
it imports only builtins, ctypes and its sibling :mod:`._nodeops` (through
the package, whose ``__init__`` modules must therefore stay import-free).
The spec comes as ``marshal`` data on stdin (written by the same interpreter
a moment before), not JSON, whose import costs more than all the mounts.
The node's init starts its boot daemons (the node agent) with
``_nodeops``' spawn, saving a second helper process, with RLIMIT_MEMLOCK
unlimited (``_nodeops.unlimit_memlock``). Failures print one line
to stderr and exit 1; the caller tears down.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import sys

# The daemon starter is shared with the node-ops helper; import it by its
# package path (this script runs with -I, so nothing is on sys.path), and
# before the pivot, while the host's paths are still visible.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from gpuclusters.linux import _nodeops

# Not `from typing import ...`: typing (with re and enum) would double the
# start-up time. mypy treats this flag like typing.TYPE_CHECKING.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MNT_DETACH = 0x2
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWCGROUP = 0x02000000
MS_PRIVATE = 1 << 18
PR_SET_DUMPABLE = 4
# The new mount API (Linux >= 5.12 for idmapped mounts): x86_64 and
# aarch64 share these numbers.
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_IDMAP = 0x00100000
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255

# Top-level names the node gets its own version of; everything else in the
# host's / is shared read-only.
PRIVATE_TOP = {"etc", "var", "run", "tmp", "dev", "proc", "sys", "mnt", "home", "root", "scratch"}
SKIP_TOP = {"lost+found"}
DEV_BINDS = ("null", "zero", "full", "random", "urandom", "tty", "kmsg")

libc = ctypes.CDLL("libc.so.6", use_errno=True)
# The host id of the node's root: 0, or the first id of its block for a
# node in a user namespace. What the boot makes as host root in the node's
# own places (its tmpfs mounts, the directories and links of its root) is
# given to it, or the node would see them owned by nobody.
OWNER = 0


def own(path: str) -> None:
    if OWNER:
        os.lchown(path, OWNER, OWNER)


def owned(opts: str) -> str:
    return f"{opts},uid={OWNER},gid={OWNER}" if OWNER else opts


def _fail(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    rc = libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        _fail(f"mount {fstype or source} on {target}")


def bind(source: str, target: str, *, recursive: bool = False, readonly: bool = False) -> None:
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0), None)
    if readonly:
        # A bind mount only becomes read-only through a second, remount call.
        mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def idmapped_tree(path: str, userns_fd: int) -> int:
    """A detached, read-only copy of the mount tree at ``path`` that shows
    host ids as the user namespace maps them (host root as the node's
    root). Made by host root, before the boot enters the node's user
    namespace: idmapping a mount needs privilege over the filesystem."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE
    fd = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), flags)
    if fd < 0:
        _fail(f"open_tree {path}")
    attr = MountAttr(attr_set=MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY, userns_fd=userns_fd)
    rc = libc.syscall(
        SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr), 32
    )
    if rc != 0:
        _fail(f"idmap {path}")
    return int(fd)


def attach(fd: int, target: str) -> None:
    """Attach a detached mount (:func:`idmapped_tree`) at ``target``."""
    rc = libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH)
    if rc != 0:
        _fail(f"attach {target}")
    os.close(fd)


def opened_top_dirs(base: str, shares: list[str]) -> set[str]:
    """The top-level directories of ``base`` a share lands in at a path
    ``base`` lacks (a host agent's /opt/gpuclusters/venv in the image's
    /opt): bound whole and read-only they would leave it no mount point, so
    the node gets a directory of its own there, with ``base``'s entries bound
    in one by one (:func:`populate_root`)."""
    out = set()
    for share in shares:
        parts = share.strip("/").split("/")
        if len(parts) < 2 or parts[0] in PRIVATE_TOP or parts[0] in SKIP_TOP:
            continue
        top = os.path.join(base, parts[0])
        lacks_mount_point = not os.path.isdir(os.path.join(base, *parts))
        if os.path.isdir(top) and not os.path.islink(top) and lacks_mount_point:
            out.add(top)
    return out


def shared_top_dirs(base: str = "/", shares: list[str] | None = None) -> list[str]:
    """The directories of ``base`` (the node image, or the host's own root)
    every node sees read-only: its top-level ones, or for one a share opens
    (:func:`opened_top_dirs`), the directories in it."""
    opened = opened_top_dirs(base, shares or [])
    out = []
    for e in os.scandir(base):
        if e.name in PRIVATE_TOP or e.name in SKIP_TOP or e.is_symlink():
            continue
        if not e.is_dir(follow_symlinks=False):
            continue
        if e.path in opened:
            out += [c.path for c in os.scandir(e.path) if c.is_dir(follow_symlinks=False)]
        else:
            out.append(e.path)
    return out


def _bind_entry(entry: os.DirEntry[str], target: str, idmapped: dict[str, int] | None) -> None:
    """One entry of the image (or host root) in the node: a symlink copied,
    a directory bound read-only (or attached through its idmapped copy), a
    file bound read-only."""
    if entry.is_symlink():
        link = os.readlink(entry.path)
        if os.path.islink(target) and os.readlink(target) == link:
            return
        if os.path.lexists(target):
            os.remove(target)
        os.symlink(link, target)
        own(target)
    elif entry.is_dir(follow_symlinks=False):
        os.makedirs(target, exist_ok=True)
        if idmapped is not None and entry.path in idmapped:
            attach(idmapped.pop(entry.path), target)
        else:
            bind(entry.path, target, recursive=True, readonly=True)
    elif entry.is_file(follow_symlinks=False):
        if not os.path.exists(target):
            open(target, "a").close()
        bind(entry.path, target, readonly=True)


def populate_root(
    root: str,
    idmapped: dict[str, int] | None = None,
    base: str = "/",
    shares: list[str] | None = None,
) -> None:
    """The node's top level: ``base``'s directories bound read-only (or
    attached through their idmapped copies), its symlinks copied (Debian's
    /bin -> usr/bin), and empty directories of the node's own for the rest.
    A top-level directory a share opens (:func:`opened_top_dirs`) is the
    node's own, with ``base``'s entries in it bound one by one."""
    opened = opened_top_dirs(base, shares or [])
    for entry in os.scandir(base):
        name, target = entry.name, os.path.join(root, entry.name)
        if name in PRIVATE_TOP or name in SKIP_TOP:
            continue
        if entry.path in opened:
            os.makedirs(target, exist_ok=True)
            os.chmod(target, 0o755)
            own(target)
            for child in os.scandir(entry.path):
                _bind_entry(child, os.path.join(target, child.name), idmapped)
            continue
        _bind_entry(entry, target, idmapped)
    for name in PRIVATE_TOP:
        os.makedirs(os.path.join(root, name), exist_ok=True)
        own(os.path.join(root, name))
    os.chmod(os.path.join(root, "root"), 0o700)


def make_dev(dev: str, gpus: int) -> None:
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, owned("mode=755,size=1m"))
    for name in DEV_BINDS:
        host = "/dev/" + name
        if os.path.exists(host):
            path = os.path.join(dev, name)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
            bind(host, path)
    pts = os.path.join(dev, "pts")
    os.mkdir(pts)
    # newinstance: the node's ptys are its own, not the host's.
    opts = f"newinstance,ptmxmode=0666,mode=620,gid={OWNER + 5}"
    mount("devpts", pts, "devpts", MS_NOSUID | MS_NOEXEC, opts)
    os.symlink("pts/ptmx", os.path.join(dev, "ptmx"))
    shm = os.path.join(dev, "shm")
    os.mkdir(shm)
    mount("tmpfs", shm, "tmpfs", MS_NOSUID | MS_NODEV, owned("mode=1777"))
    for name, link in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(link, os.path.join(dev, name))
        own(os.path.join(dev, name))
    devices = [(f"nvidia{i}", i) for i in range(gpus)]
    if gpus:
        devices.append(("nvidiactl", NVIDIACTL_MINOR))
    for name, minor in devices:
        path = os.path.join(dev, name)
        os.mknod(path, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, minor))  # S_IFCHR
        os.chmod(path, 0o666)


def _makedirs_owned(path: str) -> None:
    """``os.makedirs``, each new directory the node root's: the node's
    ldconfig makes the driver's soname links in the ones below the driver
    root."""
    if os.path.isdir(path):
        return
    _makedirs_owned(os.path.dirname(path))
    os.mkdir(path)
    own(path)


def _place(target: str, isdir: bool) -> None:
    """Make an empty file or directory for a bind mount to cover."""
    _makedirs_owned(os.path.dirname(target))
    if isdir:
        _makedirs_owned(target)
    elif not os.path.lexists(target):
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o644))


def expose_devices(root: str, devices: dict[str, Any]) -> tuple[list[str], bool]:
    """The host's real GPU/fabric devices in the node (the spec's
    ``devices``, from linux/devices.py) instead of simulated ones.

    Device nodes are bound onto empty files at their place in the node's
    /dev (a bind keeps the host node's major/minor, mode and owner, and
    works where mknod would be refused). Mounts are bound read-only where
    the node does not already see the same file: nearly everything of the
    driver lives in the host's /usr, which the node shares, so on a host with
    a packaged driver only the sockets under /run need binding. A host path
    that is gone is skipped; so is a target that cannot be placed (inside a
    read-only shared directory, or leading out of the node's root through a
    symlink). Returns one report line per entry (written to
    /run/gpuclusters/devices) and whether a library went into one of
    ``library_dirs`` (then the node's linker cache needs a refresh)."""
    report: list[str] = []
    real_root = os.path.realpath(root)

    def at(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    for host, node in devices["nodes"]:
        if not node.startswith("/dev/") or not os.path.exists(host):
            report.append(f"gone {node}")
            continue
        target = at(node)
        _place(target, False)
        os.chmod(os.path.dirname(target), 0o755)
        bind(host, target)
        report.append(f"device {node}")
    libs_bound = False
    lib_dirs = {d.rstrip("/") for d in devices.get("library_dirs", ())}
    for host, node in devices["mounts"]:
        target = at(node)
        if not os.path.exists(host):
            report.append(f"gone {node}")
            continue
        if same_file(host, target):
            report.append(f"visible {node}")
            continue
        parent = os.path.realpath(os.path.dirname(target))
        if parent != real_root and not parent.startswith(real_root + "/"):
            report.append(f"skipped {node} (leads out of the node's root)")
            continue
        isdir = os.path.isdir(host)
        try:
            _place(target, isdir)
            if os.path.isdir(target) != isdir:
                report.append(f"skipped {node} (a {'file' if isdir else 'directory'} is there)")
                continue
            bind(host, target, recursive=isdir, readonly=True)
        except OSError as exc:
            report.append(f"skipped {node} ({exc.strerror or exc})")
            continue
        report.append(f"bound {node}")
        libs_bound = libs_bound or os.path.dirname(node) in lib_dirs
    root_dir = devices.get("driver_root")
    if libs_bound and root_dir:
        # The relocated library folders are no loader default: listed for
        # the node's ldconfig (run after the pivot), which also makes the
        # soname links (libcuda.so.1) beside the bound files.
        folders = sorted(d for d in lib_dirs if d.startswith(root_dir + "/"))
        conf = at("/etc/ld.so.conf.d/gpuclusters-driver.conf")
        _makedirs_owned(os.path.dirname(conf))
        with open(conf, "w") as f:
            f.write("# The host's GPU driver (gpuclusters, linux/devices.py)\n")
            f.write("".join(d + "\n" for d in folders))
        own(conf)
        report.append(f"ldconfig {' '.join(folders)}")
    return report, libs_bound


def refresh_ldcache() -> None:
    """``ldconfig`` in the node (after the pivot): for libraries bound where
    the host's cache does not know them. Its failure only means the linker
    cache stays as it was."""
    try:
        pid = os.posix_spawnp("ldconfig", ["ldconfig"], {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        os.waitpid(pid, 0)
    except OSError:
        pass


def same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def pivot(root: str) -> None:
    # pivot_root(".", ".") stacks the old root on top of the new one; the
    # lazy unmount then drops it (runc does the same).
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(0, f"pivot_root: unsupported machine {os.uname().machine}")
    if libc.syscall(number, b".", b".") != 0:
        _fail("pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        _fail("detach old root")
    os.chdir("/")


def boot(
    spec: dict[str, Any],
    idmapped: dict[str, int] | None = None,
    enter: tuple[int, int] | None = None,
) -> int:
    """Build the node's root in this (the node's new) mount namespace and
    start its init; returns the init's host pid. ``idmapped``: detached
    idmapped mounts of host paths (a node in a user namespace), used for
    the host directories the node shares and its overlays' lower layers;
    ``enter``: the user and cgroup namespaces (fds) to enter before the
    node's init starts."""
    os.umask(0o022)
    # Inherited by the boot daemons and everything they start.
    _nodeops.unlimit_memlock()
    name = spec["hostname"].encode()
    if libc.sethostname(name, len(name)) != 0:
        _fail("sethostname")
    # Join the node's netns so the sysfs mounted below describes its links.
    fd = os.open(spec["netns"], os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        _fail("setns net")
    os.close(fd)

    root: str = spec["root"]
    userns = idmapped is not None
    global OWNER
    OWNER = int(spec.get("owner", 0))

    def at(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    bind(root, root)
    populate_root(root, idmapped, spec.get("image") or "/", list(spec["shares"]))
    for ov in spec["overlays"]:
        lower, staged = ov["lower"], None
        if idmapped is not None and lower in idmapped:
            # The lower layer through its idmapped copy, attached for the
            # overlay's mount only (overlayfs keeps its own clone).
            staged = at("/.lower-" + ov["target"].strip("/"))
            os.makedirs(staged, exist_ok=True)
            attach(idmapped.pop(lower), staged)
            lower = staged
        opts = f"lowerdir={lower},upperdir={ov['upper']},workdir={ov['work']}"
        mount("overlay", at(ov["target"]), "overlay", 0, opts)
        if staged is not None:
            if libc.umount2(staged.encode(), MNT_DETACH) != 0:
                _fail(f"detach {staged}")
            os.rmdir(staged)
    for sb in spec.get("binds", []):
        os.makedirs(at(sb["target"]), exist_ok=True)
        bind(sb["source"], at(sb["target"]))
    for eb in spec.get("etc_binds", []):
        target = at(eb["target"])
        if not os.path.exists(target):
            open(target, "a").close()  # a bind mount needs something to cover
        bind(eb["source"], target, readonly=True)
    mount("tmpfs", at("/run"), "tmpfs", MS_NOSUID | MS_NODEV, owned("mode=755"))
    for sub, mode in (("gpuclusters", 0o755), ("gpuclusters-daemons", 0o755), ("lock", 0o1777)):
        os.mkdir(at("/run/" + sub))
        os.chmod(at("/run/" + sub), mode)
        own(at("/run/" + sub))
    # The control plane's directory (agent socket) is shared by every node,
    # so it sits one level down: /run/gpuclusters itself is the node's own.
    os.mkdir(at("/run/gpuclusters/control"))
    own(at("/run/gpuclusters/control"))
    bind(spec["run_dir"], at("/run/gpuclusters/control"))
    bind(spec["tmp"], at("/tmp"))
    bind(spec["scratch"], at("/scratch"))
    if spec["shared"]:
        os.makedirs(at("/mnt/shared"), exist_ok=True)
        own(at("/mnt/shared"))
        bind(spec["shared"], at("/mnt/shared"))
    devices = spec.get("devices")
    # Real GPUs replace the simulated nvidia* nodes (bound below); a host
    # with a fabric but no GPUs keeps its simulated ones.
    real_gpus = devices is not None and int(devices.get("gpu_count", 1)) > 0
    make_dev(at("/dev"), 0 if real_gpus else int(spec["gpus"]))
    mount("sysfs", at("/sys"), "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    if not userns and os.path.isdir("/sys/fs/cgroup"):
        bind("/sys/fs/cgroup", at("/sys/fs/cgroup"), recursive=True)
    for path in spec["masks"]:
        if os.path.isdir(at(path)):
            mount("tmpfs", at(path), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    for path in spec["shares"]:
        if not same_file(path, at(path)):
            os.makedirs(at(path), exist_ok=True)
            if idmapped is not None and path in idmapped:
                attach(idmapped.pop(path), at(path))
            else:
                bind(path, at(path), recursive=True, readonly=True)
    refresh = False
    if devices:
        # Last, so that no mount above covers them.
        report, refresh = expose_devices(root, devices)
        with open(at("/run/gpuclusters/devices"), "w") as f:
            f.write("".join(line + "\n" for line in report))
    if enter is None:
        return start_init(root, spec["daemons"], spec.get("cgroups", []), refresh)
    # Into the node's user namespace, as its root. From here on host paths
    # may not be searchable: the root is reached relative to the cwd.
    os.chdir(root)
    userns_fd, cgroupns_fd = enter
    if libc.setns(userns_fd, CLONE_NEWUSER) != 0:
        _fail("setns user")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    os.setgroups([])
    if libc.setns(cgroupns_fd, CLONE_NEWCGROUP) != 0:
        _fail("setns cgroup")
    mount_cgroups("sys/fs/cgroup", spec.get("cgroup_mounts", []))
    # The cgroup leaf was joined already (by its host path, as host root).
    return start_init(".", spec["daemons"], [], refresh)


def mount_cgroups(target: str, hierarchies: list[list[str]]) -> None:
    """The node's own view of the cgroup hierarchies: mounted afresh inside
    its cgroup namespace, each shows the node's cgroup as its root (v1: a
    tmpfs with one directory per hierarchy, as on the host; v2: the unified
    hierarchy itself)."""
    if hierarchies == [["", ""]]:
        mount("cgroup2", target, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        return
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755")
    for name, opts in hierarchies:
        path = os.path.join(target, name)
        os.mkdir(path)
        mount("cgroup", path, "cgroup", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts)


def boot_in_userns(spec: dict[str, Any]) -> int:
    """Boot a node inside its user namespace (``spec["userns"]``, pinned by
    linux/userns.py).

    A child enters the user namespace and makes the node's mount, UTS, IPC
    and cgroup namespaces there, so that the node's root owns them; it
    stands in the node's cgroup meanwhile, which makes that the cgroup
    namespace's root. Then this process, still host root, joins those
    namespaces and builds the node's root (:func:`boot`): host root may
    look up and bind every host path the node needs (the server's home is
    not searchable by the node's ids), idmap the host directories the node
    shares, and make the simulated device nodes. Last it enters the user
    namespace itself and starts the node's init, whose host pid is the
    result; the caller pins the namespaces from the init's /proc."""
    userns_fd = os.open(spec["userns"], os.O_RDONLY)
    idmapped: dict[str, int] = {}
    wanted = (
        shared_top_dirs(spec.get("image") or "/", list(spec["shares"]))
        + [ov["lower"] for ov in spec["overlays"]]
        + list(spec["shares"])
    )
    for path in wanted:
        if path not in idmapped and os.path.isdir(path):
            idmapped[path] = idmapped_tree(path, userns_fd)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        os.close(go_w)
        try:
            _nodeops.join_cgroups(spec.get("cgroup_top", []))
            if libc.setns(userns_fd, CLONE_NEWUSER) != 0:
                _fail("setns user")
            if libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP) != 0:
                _fail("unshare")
            mount("none", "/", None, MS_REC | MS_PRIVATE, None)
            os.write(ready_w, b"ok")
        except OSError as exc:
            os.write(ready_w, str(exc).encode())
        os.read(go_r, 1)
        _nodeops.exit_now(0)
    os.close(ready_w)
    os.close(go_r)
    report = os.read(ready_r, 4096).decode("utf-8", "replace")
    try:
        if report != "ok":
            raise OSError(0, report or "the node's namespaces could not be made")
        kinds = (("mnt", CLONE_NEWNS), ("uts", CLONE_NEWUTS), ("ipc", CLONE_NEWIPC))
        fds = [(os.open(f"/proc/{child}/ns/{k}", os.O_RDONLY), flag) for k, flag in kinds]
        cgroupns_fd = os.open(f"/proc/{child}/ns/cgroup", os.O_RDONLY)
    finally:
        os.close(go_w)
        os.waitpid(child, 0)
    # The node's processes all descend from this one: into its leaf.
    _nodeops.join_cgroups(spec.get("cgroups", []))
    for fd, flag in fds:
        if libc.setns(fd, flag) != 0:
            _fail("setns")
        os.close(fd)
    return boot(spec, idmapped, (userns_fd, cgroupns_fd))


def start_init(root: str, daemons: list[dict[str, Any]], cgroups: list[str], refresh: bool) -> int:
    """Fork the node's init into a new PID namespace; returns its host pid
    once it has mounted /proc, pivoted into the node's root and started the
    boot daemons."""
    if libc.unshare(CLONE_NEWPID) != 0:
        _fail("unshare pid")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        node_init(root, daemons, cgroups, refresh, w)  # never returns
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    report = b"".join(chunks).decode("utf-8", "replace")
    if report != "ok":
        os.waitpid(pid, 0)
        raise OSError(0, report or "the node's init died during boot")
    return pid


def node_init(
    root: str, daemons: list[dict[str, Any]], cgroups: list[str], refresh: bool, ready: int
) -> None:
    """PID 1 of the node. Never returns."""
    try:
        os.setsid()
        # Entering the user namespace changed this process's credentials,
        # which made it undumpable: its /proc files, the namespaces a
        # hostPID pod's `nsenter -t 1` opens among them, would stay host
        # root's. The node's root owns its init.
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        # Into the node's cgroup first (by its host path, before the pivot):
        # everything of the node descends from this process and so shares
        # the node's limits (linux/nodecgroup.py).
        _nodeops.join_cgroups(cgroups)
        # A proc shows the PID namespace of the process that mounts it. It
        # is mounted before the pivot: in a user namespace the kernel allows
        # a new proc only where one is already fully visible (the host's).
        proc = os.path.join(root, "proc")
        mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        pivot(root)
        if refresh:
            refresh_ldcache()
        # Inside the node in every namespace, like a process that entered
        # it: start its boot daemons (the node agent) the way the shell's
        # spawn does. They are this init's children once their starter
        # exits (it double-forks).
        for daemon in daemons:
            _nodeops.op_spawn(daemon)
        # Nothing of the boot's pipes may stay open: the caller reads its
        # output until every holder has closed it.
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, ready)
        os.closerange(ready + 1, os.sysconf("SC_OPEN_MAX"))
    except BaseException as exc:
        try:
            os.write(ready, f"init: {exc}".encode())
        finally:
            os._exit(1)
    os.write(ready, b"ok")
    os.close(ready)
    _nodeops.reap_forever()


def main() -> int:
    try:
        spec = marshal.loads(sys.stdin.buffer.read())
        pid = boot_in_userns(spec) if spec.get("userns") else boot(spec)
    except (OSError, KeyError, ValueError, _nodeops.OpError) as exc:
        print(f"nsinit: {exc}", file=sys.stderr)
        return 1
    print(f"init {pid}")
    return 0


if __name__ == "__main__":
    _nodeops.exit_now(main())
