"""The task families: six training families of everyday shell work and two unseen ones.

Each module defines ``FAMILY`` (toy_envs.base.Family): its parameterised step kinds, each with
one fixed instruction phrasing, its canonical commands and its checks.
"""

from __future__ import annotations

from toy_envs.base import Family
from toy_envs.families import archive, config, csvdata, files, git, perms, scripts, text

FAMILIES: dict[str, Family] = {
    f.FAMILY.name: f.FAMILY for f in (files, text, perms, archive, scripts, git, csvdata, config)
}
TRAIN_FAMILIES = tuple(name for name, f in FAMILIES.items() if not f.unseen)
UNSEEN_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.unseen)
