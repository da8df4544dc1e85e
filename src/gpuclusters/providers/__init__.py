"""Node providers: they create and destroy nodes (VMs) on hosts.

``base.NodeProvider`` is the contract; ``registry`` is the explicit list of
implementations. Providers never touch the database: the controllers pass in
everything a provider needs and write back what it answers.
"""
