"""Suite-wide test settings.

Tiny models are dominated by per-op overhead, not FLOPs: one torch thread is as fast as two on
an idle 2-core machine and many times faster on a loaded one (measured: a test went from 92 s
to 2 s). Subprocesses the tests start (CLI smoke runs, tutorials) inherit OMP_NUM_THREADS.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402  (after the environment variables above, which torch reads at import)

torch.set_num_threads(1)


# The files that take longest, longest first (measured with --durations on a 2-core machine:
# the smoke recipe alone ~10 min). With `-n 2 --dist loadfile --no-loadscope-reorder` (the
# README's test command) each worker takes whole files in collection order, so starting with
# these lets the short files fill in behind them and both workers finish near the same time.
# (Without --no-loadscope-reorder xdist sorts files by their number of tests instead.)
_LONGEST_FIRST = ["test_pipeline.py", "test_distributed.py", "test_learning.py", "test_tutorials.py",
                  "test_serving.py", "test_toy_envs.py", "test_layers.py", "test_rpr.py", "test_pretrain.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within
