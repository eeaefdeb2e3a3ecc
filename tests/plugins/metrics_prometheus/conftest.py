"""Fixtures of the Prometheus sink's tests (defined in prometheus_fixtures.py, which the
tests import helpers from: every test directory's conftest is a module named `conftest`)."""

from prometheus_fixtures import populated_sink, pushgateway  # noqa: F401 - found by name
