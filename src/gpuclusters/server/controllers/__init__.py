"""Background reconcilers.

Each reconciler owns one kind of row (clusters, nodes, volumes). It picks
rows that need work, claims each with a lease (see ``leases``), advances it
by idempotent steps doing slow provider/layer calls outside any transaction,
and writes back only while its lease still holds. The API wakes reconcilers
with hints (``hints``) instead of making them wait for the next poll.
"""
