"""The node agent: a small process inside every node that reports to the
control plane. Today it sends heartbeats with the node's GPU inventory; the
health checks, the preemption notice and the GPU device plugin build on it.

It talks to the server over the unix socket the provider mounts at
``/run/gpuclusters/control/agent.sock`` and authenticates with the node's own token
(``/etc/gpuclusters/agent-token``, written by the control plane when the
node bootstraps), so a process in one node cannot speak for another.
"""
