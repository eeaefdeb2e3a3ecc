"""What runs inside the workers, apart from the training-script API.

The line between the two sides of a job: ``rallypoint.agent`` runs in the agent; this
package, and the modules a training script imports (``rallypoint.checkpoint``,
``rallypoint.data``, ``rallypoint.metrics``, ``rallypoint.progress``,
``rallypoint.record``), run in the workers and never import the agent (an import-linter
contract of ``make lint``). ``env`` names the variables the agent hands the workers;
``channel`` carries their events back; ``errors`` writes a worker's exception to its
error file; ``progress`` holds the worker's progress, which ``progress_sources`` count from
torch and ``progress_reporter`` sends to the agent's hang detection.
"""
