"""Family "text": grep, sort, count, head, tail, replace and de-duplicate lines of a file.

Every source file holds lines "fruit digit" (e.g. "plum 4"), so expected outputs are exact.
"""

from __future__ import annotations

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, fruit_lines, lit, text


def _src(a: str, src: list[str]) -> tuple[dict, Check]:
    """The source file and the check that it was left unchanged."""
    return {f"{a}.txt": File(text(src))}, Check("source_kept", f"assert lines({lit(a + '.txt')}) == {lit(src)}")


def _stale(b: str, obstacle: str, files: dict) -> obstacles.Obstacle | None:
    """read_only: an older ``b.txt`` is there, mode 0444 (added to ``files``)."""
    if obstacle != "read_only":
        return None
    files[f"{b}.txt"] = File(b"old\n", 0o444)
    return obstacles.read_only(f"{b}.txt", 0)


def _to_file(sentence, cmd, tool, a, b, src, expected, obstacle=""):
    files, kept = _src(a, src)
    ob = _stale(b, obstacle, files)
    return Step(
        sentence,
        [Cmd(cmd, reads=(f"{a}.txt",), writes=(f"{b}.txt",), **err(tool))],
        [
            Check("out_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("out_lines", f"assert lines({lit(b + '.txt')}) == {lit(expected)}"),
            kept,
        ],
        files=files,
        creates=(f"{b}.txt",),
        obstacle=ob,
    )


def _grep(p, rng, state, obstacle=""):
    a, w, b = p
    src = fruit_lines(rng, rng.randint(5, 8), must=w)
    return _to_file(f"Save the lines with {w} in {a}.txt to {b}.txt.", f"grep {w} {a}.txt > {b}.txt",
                    "grep", a, b, src, [x for x in src if w in x], obstacle)


def _sort(p, rng, state, obstacle=""):
    a, b = p
    src = fruit_lines(rng, rng.randint(5, 8))
    return _to_file(f"Save {a}.txt sorted to {b}.txt.", f"sort {a}.txt > {b}.txt", "sort", a, b, src, sorted(src), obstacle)


def _unique(p, rng, state, obstacle=""):
    a, b = p
    src = fruit_lines(rng, rng.randint(5, 8), dupes=True)
    return _to_file(f"Save the unique lines of {a}.txt to {b}.txt.", f"sort -u {a}.txt > {b}.txt",
                    "sort", a, b, src, sorted(set(src)), obstacle)


def _head(p, rng, state, obstacle=""):
    a, k, b = p
    src = fruit_lines(rng, rng.randint(5, 8))
    return _to_file(f"Save the first {k} lines of {a}.txt to {b}.txt.", f"head -n {k} {a}.txt > {b}.txt",
                    "head", a, b, src, src[:k], obstacle)


def _tail(p, rng, state, obstacle=""):
    a, k, b = p
    src = fruit_lines(rng, rng.randint(5, 8))
    return _to_file(f"Save the last {k} lines of {a}.txt to {b}.txt.", f"tail -n {k} {a}.txt > {b}.txt",
                    "tail", a, b, src, src[-k:], obstacle)


def _count(p, rng, state, obstacle=""):
    a, b = p
    src = fruit_lines(rng, rng.randint(5, 9))
    files, kept = _src(a, src)
    ob = _stale(b, obstacle, files)
    return Step(
        f"Save the number of lines in {a}.txt to {b}.txt.",
        [Cmd(f"wc -l < {a}.txt > {b}.txt", reads=(f"{a}.txt",), writes=(f"{b}.txt",), **err("redirect"))],
        [
            Check("out_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("out_number", f"assert read({lit(b + '.txt')}).strip() == {lit(str(len(src)))}"),
            kept,
        ],
        files=files,
        creates=(f"{b}.txt",),
        obstacle=ob,
    )


def _replace(p, rng, state):
    a, w, v = p
    src = fruit_lines(rng, rng.randint(5, 8), must=w)
    expected = [x.replace(w, v) for x in src]
    return Step(
        f"Replace {w} with {v} in {a}.txt.",
        [Cmd(f"sed -i 's/{w}/{v}/g' {a}.txt", reads=(f"{a}.txt",), **err("sed"))],
        [
            Check("old_gone", f"assert {lit(w)} not in read({lit(a + '.txt')})"),
            Check("new_there", f"assert {lit(v)} in read({lit(a + '.txt')})"),
            Check("lines_right", f"assert lines({lit(a + '.txt')}) == {lit(expected)}"),
        ],
        files={f"{a}.txt": File(text(src))},
    )


FAMILY = Family(
    "text",
    (
        StepKind("grep", 1, lambda r, n: (n.file(), n.fruit(), n.file()), _grep, ("read_only",)),
        StepKind("sort", 1, lambda r, n: (n.file(), n.file()), _sort, ("read_only",)),
        StepKind("unique", 1, lambda r, n: (n.file(), n.file()), _unique, ("read_only",)),
        StepKind("head", 1, lambda r, n: (n.file(), r.randint(2, 4), n.file()), _head, ("read_only",)),
        StepKind("tail", 1, lambda r, n: (n.file(), r.randint(2, 4), n.file()), _tail, ("read_only",)),
        StepKind("count", 1, lambda r, n: (n.file(), n.file()), _count, ("read_only",)),
        StepKind("replace", 1, lambda r, n: (n.file(), n.fruit(), n.fruit()), _replace),
    ),
)
