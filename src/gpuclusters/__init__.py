"""gpuclusters: a self-hostable GPU-cluster service.

Layers, with imports pointing one way only (checked by import-linter, see
pyproject.toml): ``cli`` -> ``client`` -> (HTTP) -> ``server`` (routers ->
services -> db / controllers) -> ``providers`` / ``layers`` -> ``core``.
"""

__version__ = "0.1.0"
