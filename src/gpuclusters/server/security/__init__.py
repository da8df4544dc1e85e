"""API keys and roles."""
