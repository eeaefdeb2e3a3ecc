"""A worker that does nothing: measures the launcher alone."""
