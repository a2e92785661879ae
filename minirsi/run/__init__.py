"""Runs: the recipe and everything around one run.

The run's configuration (``config``: ``RunConfig``), the five-stage recipe (``recipe``:
``minirsi run``), what each stage computes (``stages``), the run directory and its lock
(``rundir``, ``runlock``), pretraining the Base (``pretrain``), evaluation and the failure
taxonomy (``evaluate``, ``failures``), reports and audits (``report``), the memory planner
(``memplan``: ``minirsi plan``) and the learning probes (``probes``).

Rule: the top layer. It may import core, env, engine and ``minirsi.config``; nothing below
imports it (tests/test_package_layers.py).
"""
