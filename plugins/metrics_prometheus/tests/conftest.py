"""Fixtures of the Prometheus sink's tests (defined in prometheus_fixtures.py, which the
tests import helpers from: every test directory's conftest is a module named `conftest`),
and the Prometheus server of tests/servers.py of the repository (on the path through
pytest's ``pythonpath``)."""

from collections.abc import Iterator

import pytest
from prometheus_fixtures import populated_sink, pushgateway  # noqa: F401 - found by name

from rallypoint.testing.helpers import PluginManager
from servers import prometheus_server_session  # noqa: F401 - found by name


@pytest.fixture(autouse=True)
def _fresh_plugin_manager(rallypoint_pm: PluginManager) -> Iterator[None]:
    """The sinks are created through the process-wide plugin manager: a fresh one for
    each test, so that none sees what another test installed, disabled or broke."""
    yield
