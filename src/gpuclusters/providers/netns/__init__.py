"""The ``netns`` provider: the embedded fleet, nodes made of namespaces."""
