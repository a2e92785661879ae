"""minirsi: a compact reference implementation of Terminal-RSI.

Four sub-packages, each with one rule (tests/test_package_layers.py checks them):

* ``minirsi.core``: the method. TB-GAE, the rewards (FDR, SPR), the critic, the two stage types
  (RSR, RPR) and what they train on (episodes, the action format). It imports torch,
  transformers and the standard library, and nothing from the rest of minirsi. Start with
  ``core/tb_gae.py`` (credit assignment), ``core/fdr.py`` / ``core/spr.py`` (rewards), then
  ``core/rsr.py`` / ``core/rpr.py`` (the two stage types).
* ``minirsi.env``: the environment. Tasks, sandboxes, the verifier, environment layers. It
  imports nothing from the rest of minirsi either.
* ``minirsi.engine``: models and episodes. Loading the actor, samplers, the rollout engine,
  serving and weight sync; it builds the callables the core stages take. Imports core and env.
* ``minirsi.run``: runs. The five-stage recipe (``run/recipe.py``), its stages and run
  directory, evaluation, reports, pretraining, probes. Imports everything below it.

``cli.py`` dispatches the ``minirsi`` commands and ``config.py`` loads any dataclass config from
YAML; both sit at the top. Arrows go run -> engine -> env / core only, never back;
``docs/method.md`` fixes every definition.
"""

__version__ = "0.1.0"
