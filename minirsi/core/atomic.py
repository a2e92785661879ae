"""Files written whole or not at all: a reader sees the old file or the new one, never half.

The text goes to a hidden temporary file beside the target (``.NAME.tmp``, same file system),
is flushed to disk, and replaces the target with one ``os.replace`` (atomic on POSIX). Every
file a resume or a reader trusts goes through here: a run's config.yaml, calibration.json,
DONE.json, eval.json, results.json and episode JSONL files written in one go.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def atomic_open(path: str | Path) -> Iterator[IO[str]]:
    """``with atomic_open(path) as f: f.write(...)``: ``path`` appears, complete, when the block
    ends without an exception; on one the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(text)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """``obj`` as indented JSON with a final newline, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
