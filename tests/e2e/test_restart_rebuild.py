"""After a restart, nodes whose instance vanished while the server was down
are rebuilt in place: same node, same host, new instance; the cluster ends
ready again. This is the controllers' side, on the fake provider (an
instance deleted from its file); a real reboot of the embedded fleet, with
Slurm and the shared volume, is tests/e2e/test_reboot_netns.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.servers import Servers

pytestmark = pytest.mark.slow
P = "/v1/projects/default"


def test_lost_instances_are_rebuilt_after_restart(server_factory: Servers) -> None:
    server = server_factory(boot_delay_s=0.2)
    with server.client() as api:
        assert (
            api.post(
                f"{P}/clusters", json={"name": "demo", "cluster_type": "slurm", "num_gpus": 16}
            ).status_code
            == 201
        )
        server.wait_for(
            "ready",
            lambda: api.get(f"{P}/clusters/demo").json()["status"] == "ready",
            timeout=30,
        )
        before = {n["name"]: n for n in api.get(f"{P}/clusters/demo").json()["nodes"]}
    assert server.stop() == 0

    instances = server.instances()
    lost_id = sorted(instances)[0]
    lost_name = instances[lost_id]["name"]
    del instances[lost_id]
    server.write_instances(instances)

    server.start()
    with server.client() as api:

        def rebuilt() -> bool:
            # The lost node ready again *after* its rebuild (a new ready_at):
            # the instance file can hold the new instance while the API
            # still shows the node as it was before the reconciler saw it
            # vanish, ready and running, for one reconcile.
            c = api.get(f"{P}/clusters/demo").json()
            nodes = {n["name"]: n for n in c["nodes"]}
            lost = nodes.get(lost_name)
            return (
                len(server.instances()) == 2
                and c["status"] == "ready"
                and {n["phase"] for n in c["nodes"]} == {"running"}
                and lost is not None
                and lost["ready_at"] != before[lost_name]["ready_at"]
            )

        def state() -> str:
            c = api.get(f"{P}/clusters/demo").json()
            nodes = [(n["name"], n["phase"], n["message"]) for n in c["nodes"]]
            return f"cluster {c['status']}; nodes {nodes}; instances {sorted(server.instances())}"

        server.wait_for("node rebuilt", rebuilt, timeout=30, describe=state)
        after = {n["name"]: n for n in api.get(f"{P}/clusters/demo").json()["nodes"]}
    assert set(after) == set(before)  # the same nodes, none replaced
    assert {n: after[n]["host"] for n in after} == {n: before[n]["host"] for n in before}
    assert {n["phase"] for n in after.values()} == {"running"}
    assert lost_id in server.instances()
    assert after[lost_name]["ready_at"] != before[lost_name]["ready_at"]
    assert "instance lost; rebuilding" not in {n["message"] for n in after.values()}
