"""The API server: routers -> services -> db, and the controllers that
reconcile clusters, nodes and volumes in the background."""
