"""The host agent: ``gpuclusters host-agent``, one per GPU host (docs/hosts.md).

It holds the node-making code of the embedded fleet (a ``NetnsNodeProvider``
for this host only) and acts only on calls from the control plane over
mutual TLS (``api.py``); it joins with a one-use token (``join.py``),
heartbeats its inventory (``heartbeat.py``) and relays its nodes' agents to
the server (``relay.py``).
"""
