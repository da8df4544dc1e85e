"""Shared helpers for the test suite (not tests themselves)."""
