"""A change to who may log in, taken to the clusters before the call returns.

The API's calls that change SSH access (a key added or deleted, a member
added or removed, a user deleted) commit, then wake this process's access
sync and wait until one of its passes that began after the commit has
ended (``Hints.notify_and_settle``), up to ``access_apply_wait_s``. So a
key is usable by plain ``ssh`` as soon as ``ssh-keys add`` returns, and a
revocation is in force when its call returns, as a user reading the docs
expects. Past the wait the call returns anyway and the change still lands
at a later pass (a node that was unreachable, a slow pass); the caller's
connection to the database is not held while waiting.
"""

from __future__ import annotations

import logging

from gpuclusters.server.controllers import hints
from gpuclusters.server.runtime import Runtime

log = logging.getLogger(__name__)


async def access_changed(rt: Runtime) -> bool:
    """Whether the access sync pushed the change within the wait (``False``
    too where this server runs none: providers without nodes)."""
    wait_s = rt.settings.access_apply_wait_s
    if wait_s <= 0:
        rt.hints.notify(hints.ACCESS)
        return False
    pushed = await rt.hints.notify_and_settle(hints.ACCESS, wait_s)
    if not pushed and rt.node_access is not None:
        log.warning("access change not pushed to the clusters within %.0f s; it will be", wait_s)
    return pushed
