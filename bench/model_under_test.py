"""What the model benches share: the model under test (a checkpoint, or a random tiny one)."""

from __future__ import annotations

from typing import Any

from minirsi.engine.models import build_tiny_actor, build_tokenizer, load_actor


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
