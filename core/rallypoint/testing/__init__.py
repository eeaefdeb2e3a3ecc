"""The testing kit for rallypoint and for plugin authors.

* ``pytest_plugin``: the pytest plugin (entry point ``pytest11``, loaded by pytest on its
  own): fixtures ``rallypoint_pm``, ``rallypoint_register`` and ``rallypoint_runner``.
* ``helpers``: the same without pytest: ``fresh_plugin_manager``, ``plugin_registered``,
  ``CliRunner``.
* Conformance suites, one per extension point, to subclass in a plugin's tests:
  ``store_conformance.StoreConformance`` (rendezvous stores),
  ``restart_policy_conformance.RestartPolicyConformance``,
  ``rank_assigner_conformance.RankAssignerConformance``,
  ``checkpoint_storage_conformance.CheckpointStorageConformance`` and
  ``metrics_sink_conformance.MetricsSinkConformance``. They need pytest.

Importing this package imports nothing; each module imports only what it needs.
"""
