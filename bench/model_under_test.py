"""What the model benches share: the model under test (a checkpoint, or a random tiny one) and
a toy training suite to roll it out on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from minirsi.engine.models import build_tiny_actor, build_tokenizer, load_actor


def toy_tasks(folder: str | Path, n: int, seed: int = 0) -> list:
    """``n`` toy training tasks generated into ``folder`` (made readable to the sandbox's
    mounts: a ``TemporaryDirectory`` is mode 0700), loaded and sorted by id; exits naming the
    first invalid tasks if the generator wrote any."""
    from minirsi.env.tasks import load_tasks
    from toy_envs import generate_suite

    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o755)
    generate_suite("train", folder, n=n, seed=seed)
    tasks, errors = load_tasks(folder)
    if errors:
        raise SystemExit(f"toy suite in {folder} has invalid tasks: {errors[:3]}")
    return sorted(tasks, key=lambda t: t.task_id)


def load_model(path: str | None, tasks: list) -> tuple[Any, Any]:
    """(model, tokenizer) from ``path``; without one, a random tiny model with a BPE trained on
    the tasks' own text (their instructions and reference solutions), which is all the shell
    vocabulary the benches need."""
    if path:
        return load_actor(path)
    texts = [t.instruction for t in tasks]
    texts += [t.solution_script.read_text() for t in tasks if t.solution_script.is_file()]
    tok = build_tokenizer(texts * 4, vocab_size=2048)
    return build_tiny_actor(tok, seed=0), tok
