"""What the agent observes and reports: the workers' steps and heartbeats (the watchdog),
stragglers, failure reports, and the event bus with its sinks."""
