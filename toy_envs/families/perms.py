"""Family "perms": chmod files and directories (the files start at mode 644, scripts at 755)."""

from __future__ import annotations

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, lit


def _script(w: str, out: str | None = None) -> bytes:
    return f"#!/bin/bash\necho {w}{f' > {out}' if out else ''}\n".encode()


def _exec(p, rng, state):
    a, w = p
    body = _script(w)
    return Step(
        f"Make {a}.sh executable.",
        [Cmd(f"chmod +x {a}.sh", reads=(f"{a}.sh",), **err("chmod"))],
        [
            Check("owner_exec", f"assert mode({lit(a + '.sh')}) & 0o100"),
            Check("runnable", f"assert os.access(path({lit(a + '.sh')}), os.X_OK)"),
            Check("content_kept", f"assert read({lit(a + '.sh')}) == {lit(body.decode())}"),
        ],
        files={f"{a}.sh": File(body)},
    )


def _setmode(p, rng, state):
    a, m = p
    return Step(
        f"Set mode {m} on {a}.txt.",
        [Cmd(f"chmod {m} {a}.txt", reads=(f"{a}.txt",), **err("chmod"))],
        [
            Check("mode_set", f"assert mode({lit(a + '.txt')}) == 0o{m}"),
            Check("owner_bits", f"assert mode({lit(a + '.txt')}) >> 6 == {int(m[0])}"),
            Check("file_kept", f"assert os.path.isfile(path({lit(a + '.txt')}))"),
        ],
        files={f"{a}.txt": File(f"{a}\n".encode())},
    )


def _readonly(p, rng, state):
    (a,) = p
    return Step(
        f"Make {a}.txt read-only.",
        [Cmd(f"chmod a-w {a}.txt", reads=(f"{a}.txt",), **err("chmod"))],
        [
            Check("owner_no_write", f"assert not mode({lit(a + '.txt')}) & 0o200"),
            Check("nobody_writes", f"assert mode({lit(a + '.txt')}) & 0o222 == 0"),
            Check("still_readable", f"assert mode({lit(a + '.txt')}) & 0o400"),
        ],
        files={f"{a}.txt": File(f"{a}\n".encode())},
    )


def _private(p, rng, state, obstacle=""):
    d, a = p
    kept = (Check("is_dir", f"assert os.path.isdir(path({lit(d)}))") if obstacle else
            Check("file_kept", f"assert os.path.isfile(path({lit(f'{d}/{a}.txt')}))"))
    return Step(
        f"Make the directory {d} private.",
        [Cmd(f"chmod 700 {d}", reads=(d,), **err("chmod"))],
        [
            Check("dir_private", f"assert mode({lit(d)}) == 0o700"),
            Check("no_group_read", f"assert not mode({lit(d)}) & 0o044"),
            kept,
        ],
        files={} if obstacle else {f"{d}/{a}.txt": File(f"{a}\n".encode())},  # missing_dir: d is not there
        creates=(d,) if obstacle else (),
        obstacle=obstacles.missing_dir(d, 0, "chmod") if obstacle else None,
    )


def _noexec(p, rng, state):
    a, w = p
    body = _script(w)
    return Step(
        f"Make {a}.sh not executable.",
        [Cmd(f"chmod -x {a}.sh", reads=(f"{a}.sh",), **err("chmod"))],
        [
            Check("owner_no_exec", f"assert not mode({lit(a + '.sh')}) & 0o100"),
            Check("nobody_execs", f"assert mode({lit(a + '.sh')}) & 0o111 == 0"),
            Check("content_kept", f"assert read({lit(a + '.sh')}) == {lit(body.decode())}"),
        ],
        files={f"{a}.sh": File(body, 0o755)},
    )


def _exec_all(p, rng, state):
    d, a, b = p
    return Step(
        f"Make every .sh file in {d} executable.",
        [Cmd(f"chmod +x {d}/*.sh", reads=(d,), **err("chmod"))],
        [
            Check(f"{a}_exec", f"assert mode({lit(f'{d}/{a}.sh')}) & 0o100"),
            Check(f"{b}_exec", f"assert mode({lit(f'{d}/{b}.sh')}) & 0o100"),
            Check("txt_not_exec", f"assert not mode({lit(f'{d}/{a}.txt')}) & 0o100"),
        ],
        files={f"{d}/{a}.sh": File(_script(a)), f"{d}/{b}.sh": File(_script(b)), f"{d}/{a}.txt": File(b"note\n")},
    )


def _exec_run(p, rng, state, obstacle=""):
    a, w, b, d = p
    out = f"{d}/{b}.txt" if obstacle else f"{b}.txt"  # missing_dir: the script writes into d
    return Step(
        f"Make {a}.sh executable and run it.",
        [
            Cmd(f"chmod +x {a}.sh", reads=(f"{a}.sh",), **err("chmod")),
            Cmd(f"./{a}.sh", reads=(f"{a}.sh",), **err("exec")),
        ],
        [
            Check("owner_exec", f"assert mode({lit(a + '.sh')}) & 0o100"),
            Check("ran", f"assert os.path.isfile(path({lit(out)}))"),
            Check("ran_output", f"assert read({lit(out)}).strip() == {lit(w)}"),
        ],
        files={f"{a}.sh": File(_script(w, out))},
        creates=(out.split("/")[0],),
        obstacle=obstacles.missing_dir(d, 1, "script", script=f"{a}.sh", target=out) if obstacle else None,
    )


FAMILY = Family(
    "perms",
    (
        StepKind("exec", 1, lambda r, n: (n.file(), n.fruit()), _exec),
        StepKind("setmode", 1, lambda r, n: (n.file(), r.choice(("600", "640", "700", "750", "755", "444", "400"))), _setmode),
        StepKind("readonly", 1, lambda r, n: (n.file(),), _readonly),
        StepKind("private", 1, lambda r, n: (n.dir(), n.file()), _private, ("missing_dir",)),
        StepKind("noexec", 1, lambda r, n: (n.file(), n.fruit()), _noexec),
        StepKind("exec_all", 1, lambda r, n: (n.dir(), n.file(), n.file()), _exec_all),
        StepKind("exec_run", 2, lambda r, n: (n.file(), n.fruit(), n.file(), n.dir()), _exec_run, ("missing_dir",)),
    ),
)
