"""What the agent observes and reports: the workers' steps, hangs (with their stacks),
stragglers, failure reports, and the event bus with its sinks."""
