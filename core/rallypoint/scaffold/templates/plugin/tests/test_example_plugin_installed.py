"""rallypoint-example-plugin as rallypoint finds it: through its entry point, active,
registering its KIND_LABEL."""

from __future__ import annotations

from rallypoint.testing.helpers import PluginManager


def test_the_plugin_is_installed(rallypoint_pm: PluginManager) -> None:
    info = rallypoint_pm.infos.get("example-plugin")
    assert info is not None, "not installed: pip install -e '.[test]'"
    assert info.status == "active", info.error
    assert info.registered == {"KIND_LABEL": ["example-plugin"]}
