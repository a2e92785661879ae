"""toy_envs: generated shell tasks for training and evaluating minirsi on a CPU.

Six training families of everyday shell work (files, text, perms, archive, scripts, git) and
two unseen families (csv, config), each a set of parameterised steps with one fixed phrasing.
Suites (toy_envs/suites.py): train, core, hard, long, unseen. Every task is written in the
Harbor / Terminal-Bench 2 layout (toy_envs/base.py), so minirsi loads toy and real tasks alike.

    import toy_envs
    paths = toy_envs.generate_suite("core", "runs/tasks/core", n=None, seed=0)
    toy_envs.list_suites()             # ['train', 'core', 'hard', 'long', 'unseen', 'dev']
    from toy_envs import corpus
    data = corpus.sessions(1000, seed=0)              # the demonstrator's sessions (structured)

Command line: ``python -m toy_envs SUITE OUT_DIR [--n N] [--seed S]``.
Authors' guide: toy_envs/README.md.
"""

from toy_envs.families import FAMILIES, TRAIN_FAMILIES, UNSEEN_FAMILIES
from toy_envs.suites import SUITES, generate_suite, list_suites, split_of, suite_instances

__all__ = [
    "FAMILIES",
    "SUITES",
    "TRAIN_FAMILIES",
    "UNSEEN_FAMILIES",
    "generate_suite",
    "list_suites",
    "split_of",
    "suite_instances",
]
