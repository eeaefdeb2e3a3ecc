"""The agent that runs on every node, in four parts: its state machine (``statemachine``),
the worker processes (``processes``), its side of checkpoints (``checkpoints``), and what it
observes and reports (``monitoring``)."""
