"""Nodes on other machines, through their host agents (docs/hosts.md)."""
