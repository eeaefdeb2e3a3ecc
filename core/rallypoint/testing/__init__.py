"""Test helpers for rallypoint and for plugin authors (needs pytest)."""
