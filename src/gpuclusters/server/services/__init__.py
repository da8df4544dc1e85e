"""Use cases. Routers call these with keyword arguments; they validate,
authorise, change the database in one transaction and wake controllers.
They raise domain errors from ``gpuclusters.core.errors`` only."""
