"""Rendezvous: how the agents of a job agree on membership, ranks and the master address.

The agent only talks to a ``RendezvousHandler``; which handler it gets is decided once, in
``agent.rendezvous_handler.create_handler``, from the launch configuration.
"""
