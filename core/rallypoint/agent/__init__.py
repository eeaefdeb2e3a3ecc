"""The agent that runs on every node: rendezvous, workers, monitoring, restarts."""
