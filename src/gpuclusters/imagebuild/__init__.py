"""The container-image builder: a build tool, not part of the running service.

``catalog`` holds the system images' recipes and their cache (what
``scripts/build-images`` and set-up's background builder run);
``conformance`` the images the Kubernetes conformance suite pulls
(``bench/conformance.sh``). Both make layer contents as tar streams (some
from ``layers/kubernetes/images.py``'s builders, so the pause and base images
hold the very layers the nodes import) and leave the image format to umoci
(``umoci``: layouts, compression, digests), without Docker. Nothing in the
server, the layers or the providers imports this package (an import-linter
contract in ``pyproject.toml``).

    python -m gpuclusters.imagebuild.catalog build [NAME...] [--force]
    python -m gpuclusters.imagebuild.conformance build [NAME...]
"""
