"""The ``rallypoint`` command line, built from the installed plugins."""
