"""Family "config" (UNSEEN: never in the training pool or the pretraining corpus).

Edit ``key=value`` files: set, add and remove keys, and read a value out.
"""

from __future__ import annotations

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, lit, text
from toy_envs.words import FRUITS, KEYS


def _conf(rng, have: str | None, lack: str | None, avoid: str | None = None) -> list[str]:
    """Four (or three) ``key=fruit`` lines with ``have`` present, ``lack`` absent, and
    ``have``'s value never ``avoid`` (so setting it is always a change)."""
    keys = [k for k in KEYS if k not in (have, lack)]
    keys = rng.sample(keys, 3) + ([have] if have else [])
    rng.shuffle(keys)
    values = [f for f in FRUITS if f != avoid]
    return [f"{k}={rng.choice(values if k == have else FRUITS)}" for k in keys]


def _set(p, rng, state):
    a, k, v = p
    conf = _conf(rng, k, None, avoid=v)
    expected = [f"{k}={v}" if line.startswith(k + "=") else line for line in conf]
    return Step(
        f"In {a}.conf, set {k} to {v}.",
        [Cmd(f"sed -i 's/^{k}=.*/{k}={v}/' {a}.conf", reads=(f"{a}.conf",), **err("sed"))],
        [
            Check("value_set", f"assert {lit(f'{k}={v}')} in lines({lit(a + '.conf')})"),
            Check("one_entry", f"assert sum(x.startswith({lit(k + '=')}) for x in lines({lit(a + '.conf')})) == 1"),
            Check("file_right", f"assert lines({lit(a + '.conf')}) == {lit(expected)}"),
        ],
        files={f"{a}.conf": File(text(conf))},
    )


def _add(p, rng, state, obstacle=""):
    a, k, v = p
    conf = _conf(rng, None, k)
    return Step(
        f"In {a}.conf, add {k} with the value {v}.",
        [Cmd(f"echo {k}={v} >> {a}.conf", writes=(f"{a}.conf",))],
        [
            Check("key_added", f"assert {lit(f'{k}={v}')} in lines({lit(a + '.conf')})"),
            Check("others_kept", f"assert lines({lit(a + '.conf')})[:{len(conf)}] == {lit(conf)}"),
            Check("one_line_more", f"assert len(lines({lit(a + '.conf')})) == {len(conf) + 1}"),
        ],
        files={f"{a}.conf": File(text(conf), 0o444 if obstacle else 0o644)},  # read_only: the conf is 0444
        obstacle=obstacles.read_only(f"{a}.conf", 0) if obstacle else None,
    )


def _remove(p, rng, state):
    a, k = p
    conf = _conf(rng, k, None)
    expected = [line for line in conf if not line.startswith(k + "=")]
    return Step(
        f"In {a}.conf, remove the key {k}.",
        [Cmd(f"sed -i '/^{k}=/d' {a}.conf", reads=(f"{a}.conf",), **err("sed"))],
        [
            Check("key_gone", f"assert not any(x.startswith({lit(k + '=')}) for x in lines({lit(a + '.conf')}))"),
            Check("others_kept", f"assert lines({lit(a + '.conf')}) == {lit(expected)}"),
        ],
        files={f"{a}.conf": File(text(conf))},
    )


def _get(p, rng, state, obstacle=""):
    a, k, b = p
    conf = _conf(rng, k, None)
    value = next(line.split("=", 1)[1] for line in conf if line.startswith(k + "="))
    return Step(
        f"Save the value of {k} in {a}.conf to {b}.txt.",
        [Cmd(f"grep ^{k}= {a}.conf | cut -d= -f2 > {b}.txt", reads=(f"{a}.conf",), writes=(f"{b}.txt",), **err("grep"))],
        [
            Check("out_exists", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("out_value", f"assert read({lit(b + '.txt')}).strip() == {lit(value)}"),
            Check("conf_kept", f"assert lines({lit(a + '.conf')}) == {lit(conf)}"),
        ],
        # read_only: an older b.txt is there, mode 0444
        files={f"{a}.conf": File(text(conf))} | ({f"{b}.txt": File(b"old\n", 0o444)} if obstacle else {}),
        creates=(f"{b}.txt",),
        obstacle=obstacles.read_only(f"{b}.txt", 0) if obstacle else None,
    )


FAMILY = Family(
    "config",
    (
        StepKind("set", 1, lambda r, n: (n.file(), n.key(), n.fruit()), _set),
        StepKind("add", 1, lambda r, n: (n.file(), n.key(), n.fruit()), _add, ("read_only",)),
        StepKind("remove", 1, lambda r, n: (n.file(), n.key()), _remove),
        StepKind("get", 1, lambda r, n: (n.file(), n.key(), n.file()), _get, ("read_only",)),
    ),
    unseen=True,
)
