"""Family "git": commit, branch, tag, remove and ignore files in a repository at /app.

The task's set-up script (``environment/setup.sh``) makes /app a repository on branch
``main`` with a local identity and one commit "init" of the placed files; steps may add
untracked files after it. Checks call ``git`` (a few ms each) rather than parse objects.
"""

from __future__ import annotations

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, lit
from toy_envs.words import FRUITS

SETUP = (
    "git init -q -b main",
    "git config user.name toy",
    "git config user.email toy@example.com",
    "git add -A",
    "git commit -q -m init",
)

HELPERS = '''
import subprocess  # only the git family's checks run programs (an import costs a verifier ~2-7 ms)


def git(*args):
    r = subprocess.run(["git", "-c", "safe.directory=*", "-C", APP, *args], capture_output=True, text=True)
    return r.stdout


def git_ok(*args):
    r = subprocess.run(["git", "-c", "safe.directory=*", "-C", APP, *args], capture_output=True, text=True)
    return r.returncode == 0
'''


def _sha(rng) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(7))


IGNORED = ("The following paths are ignored by one of your .gitignore files:\n{path}\n"
           "hint: Use -f if you really want to add them.\nhint: Turn this message off by running\n"
           'hint: "git config advice.addIgnoredFile false"')
MODIFIED = ("error: the following file has local modifications:\n    {path}\n"
            "(use --cached to keep the file, or -f to force removal)")


def _commit(p, rng, state, obstacle=""):
    a, m = p
    w = rng.choice(FRUITS)
    out = f"[{state.branch} {_sha(rng)}] {m}\n 1 file changed, 1 insertion(+)\n create mode 100644 {a}.txt\n"
    state.head = m
    setup = (f"echo {w} > {a}.txt",)
    ob = None
    if obstacle == "needs_force":  # a.txt is ignored (by .git/info/exclude: nothing in ls shows it)
        setup += (f"echo {a}.txt >> .git/info/exclude",)
        ob = obstacles.needs_force(f"git add {a}.txt", 0, IGNORED.format(path=f"{a}.txt"), 1)
    return Step(
        f"Commit {a}.txt with the message {m}.",
        [
            Cmd(f"git add {a}.txt", reads=(f"{a}.txt",), **err("git_add")),
            Cmd(f"git commit -m {m}", output=out),
        ],
        [
            Check("tracked", f"assert git('ls-files', {lit(a + '.txt')}).strip() == {lit(a + '.txt')}"),
            Check("commit_made", f"assert {lit(m)} in git('log', '--all', '--format=%s').split()"),
            Check("commit_has_file", f"assert {lit(m)} in git('log', '--all', '--format=%s', '--', {lit(a + '.txt')}).split()"),
        ],
        setup=setup,
        creates=(f"{a}.txt",),
        obstacle=ob,
    )


def _branch(p, rng, state, obstacle=""):
    (b,) = p
    setup, ob = (), None
    if obstacle == "needs_force":  # a branch b is there already, on another commit
        setup = (f"git checkout -q -b {b}", "git commit -q --allow-empty -m old", "git checkout -q main")  # set-up runs before any step
        ob = obstacles.needs_force(f"git branch {b}", 0, f"fatal: a branch named '{b}' already exists", 128)
    return Step(
        f"Create the branch {b}.",
        [Cmd(f"git branch {b}")],
        [
            Check("branch_exists", f"assert git_ok('rev-parse', '--verify', '-q', {lit('refs/heads/' + b)})"),
            Check("branch_commit", f"assert git('log', '-1', '--format=%s', {lit(b)}).strip() == {lit(state.head)}"),
        ],
        setup=setup,
        obstacle=ob,
    )


def _tag(p, rng, state):
    (t,) = p
    return Step(
        f"Tag the last commit as {t}.",
        [Cmd(f"git tag {t}")],
        [
            Check("tag_exists", f"assert git_ok('rev-parse', '--verify', '-q', {lit('refs/tags/' + t)})"),
            Check("tag_commit", f"assert git('log', '-1', '--format=%s', {lit(t)}).strip() == {lit(state.head)}"),
        ],
    )


def _switch(p, rng, state):
    (b,) = p
    state.branch = b
    return Step(
        f"Switch to a new branch {b}.",
        [Cmd(f"git checkout -b {b}", output=f"Switched to a new branch '{b}'\n")],
        [
            Check("branch_exists", f"assert git_ok('rev-parse', '--verify', '-q', {lit('refs/heads/' + b)})"),
            Check("on_branch", f"assert git('rev-parse', '--abbrev-ref', 'HEAD').strip() == {lit(b)}"),
        ],
    )


def _switch_sample(rng, pool):
    if "__switched__" in pool.used:  # one switch per task, so "on_branch" stays true at the end
        return None
    pool.used.add("__switched__")
    return (pool.tag(),)


def _ignore_sample(rng, pool):
    if "__ignored__" in pool.used:  # one per task: a read-only .gitignore would block a second one
        return None
    pool.used.add("__ignored__")
    return (pool.file(),)


def _remove(p, rng, state, obstacle=""):
    a, m = p
    out = f"[{state.branch} {_sha(rng)}] {m}\n 1 file changed, 1 deletion(-)\n delete mode 100644 {a}.txt\n"
    state.head = m
    ob = None
    if obstacle == "needs_force":  # a.txt has changes that are not committed
        ob = obstacles.needs_force(f"git rm {a}.txt", 0, MODIFIED.format(path=f"{a}.txt"), 1)
    return Step(
        f"Remove {a}.txt from git and commit with the message {m}.",
        [
            Cmd(f"git rm {a}.txt", output=f"rm '{a}.txt'\n", reads=(f"{a}.txt",), **err("git_rm")),
            Cmd(f"git commit -m {m}", output=out),
        ],
        [
            Check("file_gone", f"assert not os.path.exists(path({lit(a + '.txt')}))"),
            Check("untracked", f"assert git('ls-files', {lit(a + '.txt')}).strip() == ''"),
            Check("commit_made", f"assert {lit(m)} in git('log', '--all', '--format=%s').split()"),
        ],
        files={f"{a}.txt": File(f"{rng.choice(FRUITS)}\n".encode())},
        setup=(f"echo {rng.choice(FRUITS)} >> {a}.txt",) if ob else (),
        obstacle=ob,
    )


def _ignore(p, rng, state, obstacle=""):
    (a,) = p
    setup = (f"echo log > {a}.log",)
    if obstacle == "read_only":  # .gitignore is there, mode 0444
        setup += ("echo '*.tmp' > .gitignore", "chmod 444 .gitignore")
    return Step(
        f"Add {a}.log to .gitignore.",
        [Cmd(f"echo {a}.log >> .gitignore", writes=(".gitignore",))],
        [
            Check("listed", f"assert {lit(a + '.log')} in lines('.gitignore')"),
            Check("ignored", f"assert git_ok('check-ignore', '-q', {lit(a + '.log')})"),
        ],
        setup=setup,
        creates=(".gitignore", f"{a}.log"),
        obstacle=obstacles.read_only(".gitignore", 0) if obstacle else None,
    )


FAMILY = Family(
    "git",
    (
        StepKind("commit", 2, lambda r, n: (n.file(), n.tag()), _commit, ("needs_force",)),
        StepKind("branch", 1, lambda r, n: (n.tag(),), _branch, ("needs_force",)),
        StepKind("tag", 1, lambda r, n: (n.tag(),), _tag),
        StepKind("switch", 1, _switch_sample, _switch),
        StepKind("remove", 2, lambda r, n: (n.file(), n.tag()), _remove, ("needs_force",)),
        StepKind("ignore", 1, _ignore_sample, _ignore, ("read_only",)),
    ),
    setup=SETUP,
    helpers=HELPERS,
    files=(("README", File(b"toy repo\n")),),
    # A fixed clock for commits: their hashes (printed by `git commit`, read back by the
    # agent) are then the same in every run, so seeded rollouts repeat exactly.
    env=(("GIT_AUTHOR_DATE", "2026-01-01T00:00:00+0000"), ("GIT_COMMITTER_DATE", "2026-01-01T00:00:00+0000")),
)
