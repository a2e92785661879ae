"""Models and episodes: the machinery between the core and the environment.

The actor (``models``: tiny preset, tokenizer, load/save, LoRA), token-in/token-out samplers
(``sampler``), the rollout engine and the callables the core stages take (``rollout``:
``collect``, ``make_rollout_fn``, ``make_replay_fn``), serving (``serve``) and weight sync
to inference servers (``weight_sync``).

Rule: imports ``minirsi.core``, ``minirsi.env`` and ``minirsi.config``, never ``minirsi.run``
(tests/test_package_layers.py).
"""
