"""The agent's state machine (``elastic.Agent``): rendezvous, start the workers, monitor
them, judge a failure, restart or stop; the signals it handles and the rendezvous handler
it drives."""
