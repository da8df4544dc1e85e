"""HTTP routers: parse, authenticate (dependencies), call one service.
No SQL and no HTTPException here; errors are domain errors mapped in
``server.errors``."""
