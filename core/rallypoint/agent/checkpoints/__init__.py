"""The agent's side of checkpoints: the node's memory tier, the copies it sends to and
fetches from other nodes' agents, the step a round resumes from, and saves on notice."""
