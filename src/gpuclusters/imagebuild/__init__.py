"""The container-image builder: a build tool, not part of the running service.

``catalog`` holds the system images' recipes and their cache (what
``scripts/build-images`` and set-up's background builder run);
``conformance`` the images the Kubernetes conformance suite pulls
(``bench/conformance.sh``). Both assemble images without Docker from the
building blocks in ``layers/kubernetes/images.py`` (the same layers nodes
import), and nothing in the server, the layers or the providers imports
this package (an import-linter contract in ``pyproject.toml``).

    python -m gpuclusters.imagebuild.catalog build [NAME...] [--force]
    python -m gpuclusters.imagebuild.conformance build [NAME...]
"""
