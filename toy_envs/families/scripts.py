"""Family "scripts": run small shell scripts, save their output, and fix them with sed.

A script ``a.sh`` is two lines: ``#!/bin/bash`` and ``echo WORD > b.txt`` (or ``echo WORD``
when its output is to be saved), mode 0755, and is run as ``./a.sh``. The bugs are a wrong
word, a wrong output file, or the typo ``ecko``. Obstacles: a script without its execute bit
(no_exec), an output file that is there read-only (read_only).
"""

from __future__ import annotations

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, lit


def _sh(line: str) -> bytes:
    return f"#!/bin/bash\n{line}\n".encode()


def _script(body: bytes, obstacle: str) -> File:
    """The script as placed: mode 0755, or 0644 when its obstacle is no_exec."""
    return File(body, 0o644 if obstacle == "no_exec" else 0o755)


def _no_exec(a: str, at: int, obstacle: str) -> obstacles.Obstacle | None:
    return obstacles.no_exec(f"{a}.sh", at) if obstacle == "no_exec" else None


def _run(p, rng, state, obstacle=""):
    a, v, b, d = p
    out = f"{d}/{b}.txt" if obstacle == "missing_dir" else f"{b}.txt"  # missing_dir: the script writes into d
    body = _sh(f"echo {v} > {out}")
    ob = _no_exec(a, 0, obstacle)
    if obstacle == "missing_dir":
        ob = obstacles.missing_dir(d, 0, "script", script=f"{a}.sh", target=out)
    return Step(
        f"Run {a}.sh.",
        [Cmd(f"./{a}.sh", reads=(f"{a}.sh",), **err("exec"))],
        [
            Check("out_exists", f"assert os.path.isfile(path({lit(out)}))"),
            Check("out_content", f"assert read({lit(out)}).strip() == {lit(v)}"),
            Check("script_kept", f"assert read({lit(a + '.sh')}) == {lit(body.decode())}"),
        ],
        files={f"{a}.sh": _script(body, obstacle)},
        creates=(out.split("/")[0],),
        obstacle=ob,
    )


def _save_output(p, rng, state, obstacle=""):
    a, v, b = p
    body = _sh(f"echo {v}")
    files = {f"{a}.sh": _script(body, obstacle)}
    ob = _no_exec(a, 0, obstacle)
    if obstacle == "read_only":  # an older b.txt is there, mode 0444
        files[f"{b}.txt"] = File(b"old\n", 0o444)
        ob = obstacles.read_only(f"{b}.txt", 0)
    return Step(
        f"Save the output of {a}.sh to {b}.txt.",
        [Cmd(f"./{a}.sh > {b}.txt", reads=(f"{a}.sh",), writes=(f"{b}.txt",), **err("exec"))],
        [
            Check("out_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("out_content", f"assert read({lit(b + '.txt')}).strip() == {lit(v)}"),
            Check("script_kept", f"assert read({lit(a + '.sh')}) == {lit(body.decode())}"),
        ],
        files=files,
        creates=(f"{b}.txt",),
        obstacle=ob,
    )


def _fix_word(p, rng, state):
    a, v, w, b = p
    return Step(
        f"Fix {a}.sh: replace {v} with {w}.",
        [Cmd(f"sed -i 's/{v}/{w}/' {a}.sh", reads=(f"{a}.sh",), **err("sed"))],
        [
            Check("new_word", f"assert {lit(w)} in read({lit(a + '.sh')})"),
            Check("old_word_gone", f"assert {lit(v)} not in read({lit(a + '.sh')})"),
            Check("script_right", f"assert lines({lit(a + '.sh')})[1] == {lit(f'echo {w} > {b}.txt')}"),
        ],
        files={f"{a}.sh": File(_sh(f"echo {v} > {b}.txt"), 0o755)},
    )


def _fix_target(p, rng, state):
    a, v, b, c = p
    return Step(
        f"Fix {a}.sh: replace {b}.txt with {c}.txt.",
        [Cmd(f"sed -i 's/{b}.txt/{c}.txt/' {a}.sh", reads=(f"{a}.sh",), **err("sed"))],
        [
            Check("new_target", f"assert {lit(c + '.txt')} in read({lit(a + '.sh')})"),
            Check("old_target_gone", f"assert {lit(b + '.txt')} not in read({lit(a + '.sh')})"),
            Check("script_right", f"assert lines({lit(a + '.sh')})[1] == {lit(f'echo {v} > {c}.txt')}"),
        ],
        files={f"{a}.sh": File(_sh(f"echo {v} > {b}.txt"), 0o755)},
    )


def _fix_typo(p, rng, state):
    a, v, b = p
    return Step(
        f"Fix {a}.sh: replace ecko with echo.",
        [Cmd(f"sed -i 's/ecko/echo/' {a}.sh", reads=(f"{a}.sh",), **err("sed"))],
        [
            Check("typo_gone", f"assert 'ecko' not in read({lit(a + '.sh')})"),
            Check("echo_there", f"assert 'echo' in read({lit(a + '.sh')})"),
            Check("script_right", f"assert lines({lit(a + '.sh')})[1] == {lit(f'echo {v} > {b}.txt')}"),
        ],
        files={f"{a}.sh": File(_sh(f"ecko {v} > {b}.txt"), 0o755)},
    )


def _fix_run(p, rng, state, obstacle=""):
    a, v, w, b = p
    return Step(
        f"Fix {a}.sh: replace {v} with {w}, then run it.",
        [
            Cmd(f"sed -i 's/{v}/{w}/' {a}.sh", reads=(f"{a}.sh",), **err("sed")),
            Cmd(f"./{a}.sh", reads=(f"{a}.sh",), **err("exec")),
        ],
        [
            Check("script_fixed", f"assert lines({lit(a + '.sh')})[1] == {lit(f'echo {w} > {b}.txt')}"),
            Check("out_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("out_content", f"assert read({lit(b + '.txt')}).strip() == {lit(w)}"),
        ],
        files={f"{a}.sh": _script(_sh(f"echo {v} > {b}.txt"), obstacle)},
        creates=(f"{b}.txt",),
        obstacle=_no_exec(a, 1, obstacle),
    )


def _typo_run(p, rng, state, obstacle=""):
    a, v, b = p
    return Step(
        f"Fix {a}.sh: replace ecko with echo, then run it.",
        [
            Cmd(f"sed -i 's/ecko/echo/' {a}.sh", reads=(f"{a}.sh",), **err("sed")),
            Cmd(f"./{a}.sh", reads=(f"{a}.sh",), **err("exec")),
        ],
        [
            Check("script_fixed", f"assert lines({lit(a + '.sh')})[1] == {lit(f'echo {v} > {b}.txt')}"),
            Check("out_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("out_content", f"assert read({lit(b + '.txt')}).strip() == {lit(v)}"),
        ],
        files={f"{a}.sh": _script(_sh(f"ecko {v} > {b}.txt"), obstacle)},
        creates=(f"{b}.txt",),
        obstacle=_no_exec(a, 1, obstacle),
    )


FAMILY = Family(
    "scripts",
    (
        StepKind("run", 1, lambda r, n: (n.file(), n.fruit(), n.file(), n.dir()), _run, ("no_exec", "missing_dir")),
        StepKind("save_output", 1, lambda r, n: (n.file(), n.fruit(), n.file()), _save_output, ("no_exec", "read_only")),
        StepKind("fix_word", 1, lambda r, n: (n.file(), n.fruit(), n.fruit(), n.file()), _fix_word),
        StepKind("fix_target", 1, lambda r, n: (n.file(), n.fruit(), n.file(), n.file()), _fix_target),
        StepKind("fix_typo", 1, lambda r, n: (n.file(), n.fruit(), n.file()), _fix_typo),
        StepKind("fix_run", 2, lambda r, n: (n.file(), n.fruit(), n.fruit(), n.file()), _fix_run, ("no_exec",)),
        StepKind("typo_run", 2, lambda r, n: (n.file(), n.fruit(), n.file()), _typo_run, ("no_exec",)),
    ),
)
