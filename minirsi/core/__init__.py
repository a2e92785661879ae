"""The method: what Terminal-RSI computes, with nothing of the machinery that feeds it.

TB-GAE (``tb_gae``, ``tb_gae_fast``), the rewards (``fdr``, ``spr``, ``reward_audit``), the
critic (``critic``), the two stage types (``rsr``: clean, plan, re-verify, SFT; ``rpr``: PPO),
and what they train on: episodes and batches (``episode``), the action format and its ChatML
rendering (``actions``), chunked scoring (``scoring``), sharding over ranks (``distributed``),
atomic writes (``atomic``).

Rule: a module here imports torch, transformers, safetensors and the standard library, and from
minirsi only ``minirsi.core`` (tests/test_package_layers.py). What touches a sandbox, a sampler
or a run directory is passed in as a callable (``rollout_fn``, ``replay_fn``,
``sampler_factory``), built by ``minirsi.engine``.
"""
