"""Capacity logic as pure functions: placement of nodes on hosts, choice of
nodes to remove. No I/O; callers pass in snapshots and apply the answer."""
