"""Health as pure logic: what a node's state means (findings, alerts) and
what to do about it (repair rules, escalation, policy). No I/O: the node
agent and the server feed in snapshots and act on the answers."""
