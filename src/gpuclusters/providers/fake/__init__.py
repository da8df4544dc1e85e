"""The in-process fake provider: bookkeeping only, for tests and scale work."""
