"""A task's layers, found or built together: its environment, test tools (apt, pip) and package
index (minirsi/env/layers.py builds one layer; minirsi/env/wheelhouse.py the index).

Call::

    prepared, built = prepare(task, rootfs)   # build what is missing (network), else reuse
    prepared = find_prepared(task, rootfs)    # None if not prepared (no work, no network)

(``rootfs``: the Debian 12 one, minirsi.env.sandbox.bwrap.default_rootfs(); a trixie task's base is
its sibling, ``base_rootfs``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from minirsi.env.layers import (LayerError, Prepared, ToolSpec, _apt_steps, _base_ready, _build, _dockerfile,
                                _env_steps, _layer, _pip_steps, apt_key, base_rootfs, ensure_base, environment_key,
                                pip_key, read_tool_spec)
from minirsi.env.wheelhouse import index_key, prepare_index, read_index_specs


def find_prepared(task, rootfs: Path) -> Prepared | None:
    """The task's layers if they are all prepared, else None (no work beyond hashing).

    ``rootfs``: the Debian 12 rootfs; the task's base is base_rootfs(its release, rootfs)."""
    df = _dockerfile(task)
    base = base_rootfs(df.release, rootfs)
    if df.release != "bookworm" and not _base_ready(base):
        return None
    key = environment_key(task, base)
    env_layer = _layer(key)
    if env_layer is None:
        return None
    spec = read_tool_spec(task.test_script) if task.test_script.is_file() else ToolSpec()
    apt = _layer(apt_key(key, spec.apt)) if spec.apt else None
    pip = _layer(pip_key(base, spec.pip)) if spec.pip else None
    if (spec.apt and apt is None) or (spec.pip and pip is None):
        return None
    groups = read_index_specs(task)
    index = _layer(index_key(key, groups)) if groups else None
    if groups and index is None:
        return None
    return Prepared(env_layer, base, apt, pip, dict(df.env), tuple(df.notes), spec.system, index)


def prepare(task, rootfs: Path, log: Callable[[str], None] = lambda s: None) -> tuple[Prepared, bool]:
    """Build the task's missing layers (with the network); return (prepared, whether anything was built).

    ``rootfs``: the Debian 12 rootfs; a task whose base is another release's (Dockerfile.release)
    gets that base built first if missing (ensure_base). Raises DockerfileError for a line that
    cannot be honoured and LayerError for a step that failed.
    """
    df = _dockerfile(task)
    rootfs, built = ensure_base(df.release, rootfs, log)  # from here on, `rootfs` is the task's base
    key = environment_key(task, rootfs)
    timeout = float(task.environment.get("build_timeout_sec", 1800.0))
    env_layer = _layer(key)
    if env_layer is None:
        log(f"{task.task_id}: preparing environment layer {key} from {task.dockerfile}")
        try:
            env_layer = _build(key, [rootfs], _env_steps(df, task.environment_dir), task.environment_dir, timeout,
                               {"kind": "environment", "dockerfile": str(task.dockerfile), "base": df.base,
                                "base_rootfs": str(rootfs), "notes": df.notes, "env": df.env, "workdir": df.workdir},
                               log)
        except LayerError as e:
            if not df.notes:
                raise
            # a RUN that works on the image's own release may not on the local base: say so with the failure
            raise LayerError(f"{e}\n(base differs: {'; '.join(df.notes)})") from e
        built = True
    spec = read_tool_spec(task.test_script) if task.test_script.is_file() else ToolSpec()
    apt = pip = None
    if spec.apt:
        akey = apt_key(key, spec.apt)
        apt = _layer(akey)
        if apt is None:
            log(f"{task.task_id}: preparing test.sh's apt layer {akey} ({' '.join(spec.apt)})")
            apt = _build(akey, [env_layer.upper, rootfs], _apt_steps(task.test_script, spec.apt), None, timeout,
                         {"kind": "apt", "env_layer": key, "apt": spec.apt}, log)
            built = True
    if spec.pip:
        pkey = pip_key(rootfs, spec.pip)
        pip = _layer(pkey)
        if pip is None:
            log(f"{task.task_id}: preparing test tools {pkey} ({' '.join(spec.pip)})")
            pip = _build(pkey, [rootfs], _pip_steps(task.test_script, spec.pip), None, timeout,
                         {"kind": "pip", "pip": spec.pip, "base_rootfs": str(rootfs)}, log)
            built = True
    index, index_built = prepare_index(task, env_layer, rootfs, timeout, log)
    return Prepared(env_layer, rootfs, apt, pip, dict(df.env), tuple(df.notes), spec.system, index), built or index_built
