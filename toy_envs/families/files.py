"""Family "files": create, copy, rename, move and delete files and directories."""

from __future__ import annotations

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, lit, text
from toy_envs.words import FRUITS


def _content(rng) -> bytes:
    return text([f"{rng.choice(FRUITS)} {rng.randint(1, 9)}" for _ in range(rng.randint(1, 3))])


def _mkdir(p, rng, state):
    (d,) = p
    return Step(
        f"Create the directory {d}.",
        [Cmd(f"mkdir {d}", writes=(d,))],
        [
            Check("exists", f"assert os.path.exists(path({lit(d)}))"),
            Check("is_dir", f"assert os.path.isdir(path({lit(d)}))"),
            Check("empty", f"assert os.listdir(path({lit(d)})) == []"),
        ],
        creates=(d,),
    )


def _copy(p, rng, state, obstacle=""):
    a, b = p
    c = _content(rng)
    files = {f"{a}.txt": File(c)}
    if obstacle == "read_only":  # an older b.txt is there, mode 0444
        files[f"{b}.txt"] = File(_content(rng), 0o444)
    return Step(
        f"Copy {a}.txt to {b}.txt.",
        [Cmd(f"cp {a}.txt {b}.txt", reads=(f"{a}.txt",), writes=(f"{b}.txt",), **err("cp"))],
        [
            Check("copy_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("copy_content", f"assert read({lit(b + '.txt')}) == {lit(c.decode())}"),
            Check("source_kept", f"assert read({lit(a + '.txt')}) == {lit(c.decode())}"),
        ],
        files=files,
        creates=(f"{b}.txt",),
        obstacle=obstacles.read_only(f"{b}.txt", 0, "cp") if obstacle else None,
    )


def _rename(p, rng, state):
    a, b = p
    c = _content(rng)
    return Step(
        f"Rename {a}.txt to {b}.txt.",
        [Cmd(f"mv {a}.txt {b}.txt", reads=(f"{a}.txt",), writes=(f"{b}.txt",), **err("mv"))],
        [
            Check("new_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("new_content", f"assert read({lit(b + '.txt')}) == {lit(c.decode())}"),
            Check("old_gone", f"assert not os.path.exists(path({lit(a + '.txt')}))"),
        ],
        files={f"{a}.txt": File(c)},
        creates=(f"{b}.txt",),
    )


def _delete(p, rng, state):
    a, b = p
    return Step(
        f"Delete {a}.txt.",
        [Cmd(f"rm {a}.txt", reads=(f"{a}.txt",), **err("rm"))],
        [
            Check("deleted", f"assert not os.path.exists(path({lit(a + '.txt')}))"),
            Check("other_kept", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
        ],
        files={f"{a}.txt": File(_content(rng)), f"{b}.txt": File(_content(rng))},
    )


def _write(p, rng, state, obstacle=""):
    a, w = p
    # read_only: an older a.txt is there, mode 0444
    old = {f"{a}.txt": File(_content(rng), 0o444)} if obstacle == "read_only" else {}
    return Step(
        f"Write {w} to {a}.txt.",
        [Cmd(f"echo {w} > {a}.txt", writes=(f"{a}.txt",))],
        [
            Check("file_exists", f"assert os.path.isfile(path({lit(a + '.txt')}))"),
            Check("file_content", f"assert read({lit(a + '.txt')}).strip() == {lit(w)}"),
        ],
        files=old,
        creates=(f"{a}.txt",),
        obstacle=obstacles.read_only(f"{a}.txt", 0) if old else None,
    )


def _move_new_dir(p, rng, state):
    a, d = p
    c = _content(rng)
    return Step(
        f"Move {a}.txt into a new directory {d}.",
        [Cmd(f"mkdir {d}", writes=(d,)), Cmd(f"mv {a}.txt {d}/", reads=(f"{a}.txt",), **err("mv"))],
        [
            Check("dir_exists", f"assert os.path.isdir(path({lit(d)}))"),
            Check("moved", f"assert read({lit(f'{d}/{a}.txt')}) == {lit(c.decode())}"),
            Check("old_gone", f"assert not os.path.exists(path({lit(a + '.txt')}))"),
        ],
        files={f"{a}.txt": File(c)},
        creates=(d,),
    )


def _copy_into(p, rng, state, obstacle=""):
    a, d, b = p
    c = _content(rng)
    files = {f"{a}.txt": File(c), f"{d}/{b}.txt": File(_content(rng))}
    if obstacle == "missing_dir":  # d is not there
        del files[f"{d}/{b}.txt"]
    return Step(
        f"Copy {a}.txt into {d}.",
        [Cmd(f"cp {a}.txt {d}/", reads=(f"{a}.txt",), **err("cp"))],
        [
            Check("copied", f"assert os.path.isfile(path({lit(f'{d}/{a}.txt')}))"),
            Check("copy_content", f"assert read({lit(f'{d}/{a}.txt')}) == {lit(c.decode())}"),
            Check("source_kept", f"assert os.path.isfile(path({lit(a + '.txt')}))"),
        ],
        files=files,
        creates=(d,) if obstacle else (),
        obstacle=obstacles.missing_dir(d, 0, "cp") if obstacle else None,
    )


def _nested(p, rng, state):
    d, e = p
    return Step(
        f"Create the directory {d}/{e}.",
        [Cmd(f"mkdir -p {d}/{e}", writes=(d,))],
        [
            Check("parent", f"assert os.path.isdir(path({lit(d)}))"),
            Check("child", f"assert os.path.isdir(path({lit(f'{d}/{e}')}))"),
        ],
        creates=(d,),
    )


FAMILY = Family(
    "files",
    (
        StepKind("mkdir", 1, lambda r, n: (n.dir(),), _mkdir),
        StepKind("copy", 1, lambda r, n: (n.file(), n.file()), _copy, ("read_only",)),
        StepKind("rename", 1, lambda r, n: (n.file(), n.file()), _rename),
        StepKind("delete", 1, lambda r, n: (n.file(), n.file()), _delete),
        StepKind("write", 1, lambda r, n: (n.file(), n.fruit()), _write, ("read_only",)),
        StepKind("move_new_dir", 2, lambda r, n: (n.file(), n.dir()), _move_new_dir),
        StepKind("copy_into", 1, lambda r, n: (n.file(), n.dir(), n.file()), _copy_into, ("missing_dir",)),
        StepKind("nested_dir", 1, lambda r, n: (n.dir(), n.dir()), _nested),
    ),
)
