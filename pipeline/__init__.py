"""sluice: asynchronous RL post-training around a durable sample queue.

Layers, lowest first (docs/architecture.md has the folder map; tests/e2e/test_import_graph.py holds the order):
``errors``, ``net``, ``plugins``, ``config`` (the recipe schema, a leaf); ``metrics`` (sinks), ``rundir`` (the run
folder), ``models``, ``data`` (prompt sources); the stages ``queue`` and ``sync``, then ``producers`` and
``consumers``, which meet only through the queue; ``heldout`` (evaluation that generates) above both; ``launch``,
``observe``, ``cli`` and ``benchmarks`` on top.
"""

__version__ = "0.1.0"
