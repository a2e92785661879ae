"""Family "csv" (UNSEEN: never in the training pool or the pretraining corpus).

Data wrangling on headerless CSV files ``fruit,color,number`` with cut, grep, awk, sort, wc.
"""

from __future__ import annotations

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, lit, text
from toy_envs.words import DIRS, FRUITS


def _rows(rng, must: str | None = None) -> list[str]:
    n = rng.randint(4, 7)
    nums = rng.sample(range(1, 60), n)  # distinct, so sorting by number has no ties
    others = [f for f in FRUITS if f != must]
    fruits = [rng.choice(others) for _ in range(n)]
    if must is not None:
        for i in rng.sample(range(n), rng.randint(1, 2)):
            fruits[i] = must
    return [f"{f},{rng.choice(DIRS)},{x}" for f, x in zip(fruits, nums)]


def _out(sentence, cmd, tool, a, b, rows, expected, ext=".txt", obstacle=""):
    files = {f"{a}.csv": File(text(rows))}
    if obstacle == "read_only":  # an older output file is there, mode 0444
        files[b + ext] = File(b"old\n", 0o444)
    return Step(
        sentence,
        [Cmd(cmd, reads=(f"{a}.csv",), writes=(b + ext,), **err(tool))],
        [
            Check("out_exists", f"assert os.path.isfile(path({lit(b + ext)}))"),
            Check("out_lines", f"assert lines({lit(b + ext)}) == {lit(expected)}"),
            Check("source_kept", f"assert lines({lit(a + '.csv')}) == {lit(rows)}"),
        ],
        files=files,
        creates=(b + ext,),
        obstacle=obstacles.read_only(b + ext, 0) if obstacle else None,
    )


def _column(p, rng, state, obstacle=""):
    a, k, b = p
    rows = _rows(rng)
    return _out(f"Save column {k} of {a}.csv to {b}.txt.", f"cut -d, -f{k} {a}.csv > {b}.txt", "cut",
                a, b, rows, [r.split(",")[k - 1] for r in rows], obstacle=obstacle)


def _rows_with(p, rng, state, obstacle=""):
    a, w, b = p
    rows = _rows(rng, must=w)
    return _out(f"Save the rows with {w} in {a}.csv to {b}.csv.", f"grep {w} {a}.csv > {b}.csv", "grep",
                a, b, rows, [r for r in rows if w in r], ext=".csv", obstacle=obstacle)


def _sum(p, rng, state, obstacle=""):
    a, b = p
    rows = _rows(rng)
    total = sum(int(r.split(",")[2]) for r in rows)
    return _out(f"Save the sum of column 3 of {a}.csv to {b}.txt.",
                f"awk -F, '{{s+=$3}} END {{print s}}' {a}.csv > {b}.txt", "awk", a, b, rows, [str(total)], obstacle=obstacle)


def _count(p, rng, state, obstacle=""):
    a, b = p
    rows = _rows(rng)
    return _out(f"Save the number of rows in {a}.csv to {b}.txt.", f"wc -l < {a}.csv > {b}.txt", "redirect",
                a, b, rows, [str(len(rows))], obstacle=obstacle)


def _sort_num(p, rng, state, obstacle=""):
    a, b = p
    rows = _rows(rng)
    return _out(f"Save {a}.csv sorted by column 3 to {b}.csv.", f"sort -t, -k3 -n {a}.csv > {b}.csv", "sort",
                a, b, rows, sorted(rows, key=lambda r: int(r.split(",")[2])), ext=".csv", obstacle=obstacle)


FAMILY = Family(
    "csv",
    (
        StepKind("column", 1, lambda r, n: (n.file(), r.randint(1, 3), n.file()), _column, ("read_only",)),
        StepKind("rows_with", 1, lambda r, n: (n.file(), n.fruit(), n.file()), _rows_with, ("read_only",)),
        StepKind("sum", 1, lambda r, n: (n.file(), n.file()), _sum, ("read_only",)),
        StepKind("count", 1, lambda r, n: (n.file(), n.file()), _count, ("read_only",)),
        StepKind("sort_num", 1, lambda r, n: (n.file(), n.file()), _sort_num, ("read_only",)),
    ),
    unseen=True,
)
