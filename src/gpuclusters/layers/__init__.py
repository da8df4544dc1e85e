"""Cluster layers: orchestrators laid over a cluster's nodes (Kubernetes on
every cluster, Slurm on top for Slurm clusters). ``base.ClusterLayer`` is the
contract; ``noop`` is the layer used with the fake provider."""
