"""The node's worker processes: their keeper and its subreaper, the preloaded interpreter
that warm-starts them, their environment, output, CPUs, and the wire between them and the
agent. The keeper and the preloaded interpreter import their stdlib-only modules from this
folder without the package (``keeper_server``, ``zygote``): this file imports nothing."""
