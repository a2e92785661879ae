"""The environment the agent acts in: tasks, sandboxes, the verifier.

Task loading (``tasks``), Dockerfiles and the environment layers and package indexes a task is
prepared with (``dockerfile``, ``layers``, ``wheelhouse``; ``prepare`` finds or builds them
together), the sandboxes (``sandbox/``), the
protected verifier (``verifier``), and ``minirsi task`` (``task_cli``).

Rule: imports nothing from minirsi outside ``minirsi.env`` (tests/test_package_layers.py).
"""
