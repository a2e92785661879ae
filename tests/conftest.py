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
