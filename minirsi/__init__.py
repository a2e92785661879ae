"""minirsi: a compact reference implementation of Terminal-RSI.

One file per idea; start with ``tb_gae.py`` (credit assignment), ``fdr.py`` / ``spr.py``
(rewards), then ``rsr.py`` / ``rpr.py`` (the two stage types) and ``recipe.py`` (the
five-stage recipe). ``docs/method.md`` fixes every definition.
"""

__version__ = "0.1.0"
