"""Linux primitives of the embedded fleet: nodes made of namespaces.

A node is a named network namespace, a mount namespace and a UTS
namespace, each pinned by an nsfs bind mount (``/run/netns/gpc-…``,
``<ns dir>/<id>.mnt``, ``<ns dir>/<id>.uts``). Pinned namespaces are not
processes, so a node outlives the server and needs no init inside; a host
reboot drops the pins, and the node reads as missing.

Modules, bottom up:

``run``      the one async subprocess helper (argv only, timeouts, typed errors)
``sysmount`` mount/umount2 via ctypes for the host side; mountinfo queries
``layout``   names and paths of a node, a pure function of its id
``network``  per-cluster bridge, per-node netns + veth (iproute2 batches)
``procs``    find/kill a node's processes via /proc/*/ns/{net,mnt}
``machine``  boot / power off / wipe / destroy a node
``shell``    ``NamespaceShell``, the ``core.nodeshell.NodeShell`` of a node
``_nsinit``  stdlib-only script that builds a node's root inside its new
             mount namespace and pivots into it (see its docstring for the
             mount table)
``_nodeops`` stdlib-only script that joins a node's namespaces to read and
             write files and start/stop daemons

This package knows nothing of providers, clusters as records, or the
control plane: it sits below ``gpuclusters.providers`` and above
``gpuclusters.core`` (import-linter layers). Everything needs root.

Keep this module free of imports: the ``_nsinit`` helper imports
``_nodeops`` through it, and its start-up time is a node's creation time.
"""
