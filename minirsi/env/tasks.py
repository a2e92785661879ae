"""Load shell tasks in the Harbor / Terminal-Bench 2 layout (docs/method.md section 1).

A task is a directory::

    <task-id>/
      instruction.md          what the agent sees
      task.toml               [metadata] difficulty, category (= family f), tags
                              [agent] timeout_sec; [verifier] timeout_sec, env
                              [environment] see below
      environment/            files copied into the work directory (and an optional Dockerfile)
      solution/solve.sh       the oracle (never shown to the agent)
      tests/test.sh           the verifier; runs tests/test_outputs.py with pytest

``[environment]`` fields. Harbor's own (``build_timeout_sec``, ``docker_image``, ``cpus``,
``memory_mb`` or ``memory = "2G"``, ``storage_mb``, ``allow_internet``) are kept in
``Task.environment``; minirsi reads ``memory_mb``/``memory`` as the sandbox memory limit and
ignores the rest (sandboxes are always offline). minirsi adds:

- ``workdir`` (default: the Dockerfile's last ``WORKDIR`` if there is one, else ``/app``): where
  the agent starts and where ``environment/`` files land (a task without a Dockerfile).
- ``setup`` (default none): a script inside ``environment/``, run as the agent's user in the
  work directory, offline, before the agent starts (``setup_timeout_sec``, default 60). It is
  not copied into the work directory. It cannot leave services running (its jail ends).
- ``runs_on_base`` (default false): only read when ``environment/Dockerfile`` exists. On the
  local bubblewrap backend a task with a Dockerfile runs on its prepared environment layer
  (``minirsi task prepare``; minirsi/env/layers.py). ``runs_on_base = true`` skips the Dockerfile
  there instead: the base rootfs plus ``environment/`` files and ``setup`` stand for the image.
- ``pip_packages`` (default none): requirement strings (``["requests==2.32.5", "scipy"]``) that
  ``minirsi task prepare`` adds to the task's package index, beside those its files name in
  ``pip install`` lines (minirsi/env/wheelhouse.py); read for tasks with a Dockerfile, on the local
  backend.
- ``[environment.env]`` (default none): variables set in the agent's shell and the setup
  script, NAME = "value" (the toy git tasks fix the commit clock with them, so that commit
  hashes, which the agent reads, repeat between runs).

The older Terminal-Bench 1 layout (``task.yaml`` with ``instruction``, ``difficulty``,
``category``, ``tags``, ``max_agent_timeout_sec``, ``max_test_timeout_sec``; ``solution.sh``;
``run-tests.sh``; ``tests/``) loads too; its tasks have no ``reward.txt``, so the verifier falls
back to "test script exited 0 and every check passed" for S.

Call::

    task = load_task("path/to/task")              # raises TaskError naming file, field, fix
    tasks, errors = load_tasks("path/to/suite")   # good tasks, and one TaskError per bad one
"""

from __future__ import annotations

import difflib
import logging
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

DIFFICULTIES = ("easy", "medium", "hard", "extreme")
DEFAULT_AGENT_TIMEOUT_SEC = 600.0
DEFAULT_VERIFIER_TIMEOUT_SEC = 300.0
DEFAULT_WORKDIR = "/app"
# Paths the sandbox mounts itself; a task's workdir may not sit on or under them.
_RESERVED_DIRS = ("/tests", "/logs", "/proc", "/dev", "/sys", "/tmp", "/opt/minirsi", "/solution")
# The task.toml keys Harbor (schema 1.0 and 1.1) and minirsi read: anything else is a typo
# (reported with the nearest of these) except in [metadata] and [task], which are free-form
# (there only a near miss of a known key is reported).
KNOWN_KEYS: dict[str, tuple[str, ...]] = {
    "": ("version", "schema_version", "artifacts", "task", "metadata", "agent", "verifier", "environment", "solution",
         "source"),
    "metadata": ("difficulty", "category", "tags", "author_name", "author_email", "expert_time_estimate_min",
                 "junior_time_estimate_min"),
    "agent": ("timeout_sec", "user"),
    "verifier": ("timeout_sec", "env", "user"),
    "solution": ("env",),
    "environment": ("build_timeout_sec", "docker_image", "cpus", "memory_mb", "memory", "storage_mb", "storage",
                    "gpus", "gpu_types", "allow_internet", "mcp_servers", "env", "workdir", "setup",
                    "setup_timeout_sec", "runs_on_base", "pip_packages"),
}
_FREE_FORM = ("metadata", "task")


class TaskError(ValueError):
    """A malformed task: the message names the file, the field and the fix."""

    def __init__(self, path: Path | str, field_name: str, problem: str, fix: str):
        self.path = Path(path)
        self.field_name = field_name
        super().__init__(f"{path}: {field_name}: {problem}. Fix: {fix}")


@dataclass(frozen=True)
class Task:
    """One task directory, validated."""

    task_id: str
    """The directory name."""
    path: Path
    """The task directory (absolute)."""
    instruction: str
    """instruction.md (TB1: task.yaml `instruction`): what the agent sees."""
    family: str
    """f: `[metadata] category`."""
    difficulty: str
    """easy | medium | hard | extreme."""
    tags: tuple[str, ...] = ()
    agent_timeout_sec: float = DEFAULT_AGENT_TIMEOUT_SEC
    verifier_timeout_sec: float = DEFAULT_VERIFIER_TIMEOUT_SEC
    workdir: str = DEFAULT_WORKDIR
    """Absolute path inside the sandbox where the agent starts (`[environment] workdir`)."""
    environment: dict[str, Any] = field(default_factory=dict)
    """The raw `[environment]` table."""
    verifier_env: dict[str, str] = field(default_factory=dict)
    """`[verifier] env`: extra variables for tests/test.sh."""
    agent_env: dict[str, str] = field(default_factory=dict)
    """`[environment.env]`: extra variables for the agent's shell and the setup script."""
    layout: str = "harbor"
    """harbor (Terminal-Bench 2) | tb1 (Terminal-Bench 1)."""

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def test_script(self) -> Path:
        """The verifier entry point on the host; inside the sandbox it runs from /tests."""
        return self.path / ("tests/test.sh" if self.layout == "harbor" else "run-tests.sh")

    @property
    def solution_script(self) -> Path:
        return self.path / ("solution/solve.sh" if self.layout == "harbor" else "solution.sh")

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def dockerfile(self) -> Path | None:
        p = self.environment_dir / "Dockerfile"
        return p if p.is_file() else None

    @property
    def uses_layer(self) -> bool:
        """On the local backend this task runs on a prepared environment layer (it has a
        Dockerfile and does not set ``runs_on_base``)."""
        return self.dockerfile is not None and not self.environment.get("runs_on_base", False)

    @property
    def setup_script(self) -> Path | None:
        name = self.environment.get("setup")
        return self.environment_dir / name if name else None

    @property
    def setup_timeout_sec(self) -> float:
        return float(self.environment.get("setup_timeout_sec", 60.0))

    @property
    def memory_mb(self) -> int | None:
        """`memory_mb`, or Harbor's older `memory = "2G"` spelling, or None."""
        if "memory_mb" in self.environment:
            return int(self.environment["memory_mb"])
        if "memory" in self.environment:
            return _parse_size_mb(self.task_toml, "environment.memory", self.environment["memory"])
        return None

    @property
    def task_toml(self) -> Path:
        return self.path / ("task.toml" if self.layout == "harbor" else "task.yaml")


def _parse_size_mb(path: Path, field_name: str, value: Any) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)[bB]?\s*", str(value))
    if not m:
        raise TaskError(path, field_name, f"cannot read size {value!r}",
                        f'replace {field_name.rpartition(".")[2]} = {_toml_repr(value)} with a size such as "2G" or "512M" '
                        '(or use memory_mb = 2048)')
    scale = {"": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024}[m.group(2).lower()]
    return max(1, int(float(m.group(1)) * scale))


def _positive(path: Path, field_name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        section, _, key = field_name.rpartition(".")
        where = f" under [{section}]" if section else ""
        hint = _number_hint(value)
        raise TaskError(path, field_name, f"must be a positive number, got {value!r}",
                        f"replace {key} = {_toml_repr(value)}{where} with a positive number"
                        + (f", e.g. {key} = {hint}" if hint else ""))
    return float(value)


def _toml_repr(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _number_hint(value: Any) -> str | None:
    """What the user probably meant by a bad number: "600" -> 600, -5 -> 5, "10m" -> 600."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)?\s*", value)
        if m:
            scale = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
            return repr(float(m.group(1)) * scale)
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        return repr(-value)
    return None


def check_keys(source: Path, config: dict[str, Any]) -> None:
    """Raise TaskError for an unknown section or key, naming the nearest known one (difflib)."""
    def near(name: str, known: tuple[str, ...]) -> str | None:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
        return close[0] if close else None

    for key, value in config.items():
        if key not in KNOWN_KEYS[""]:
            guess = near(key, KNOWN_KEYS[""])
            kind = "section" if isinstance(value, dict) else "key"
            shown = f"[{key}]" if kind == "section" else key
            raise TaskError(source, shown, f"unknown {kind}",
                            f"rename {shown} to " + (f"[{guess}]" if kind == "section" else guess) if guess
                            else f"remove {shown} (known: {', '.join(KNOWN_KEYS[''])})")
    for section, known in KNOWN_KEYS.items():
        table = config.get(section) if section else None
        if not isinstance(table, dict):
            continue
        for key in table:
            if key in known:
                continue
            guess = near(key, known)
            if guess is None and section in _FREE_FORM:
                continue
            raise TaskError(source, f"{section}.{key}", "unknown key",
                            f"rename {key} to {guess} under [{section}]" if guess
                            else f"remove {key} from [{section}] (known: {', '.join(known)})")


def dockerfile_workdir(dockerfile: Path) -> str | None:
    """The last absolute WORKDIR of a Dockerfile (a lenient scan; the full parse is in dockerfile.py)."""
    found = None
    try:
        text = dockerfile.read_text(errors="replace")
    except OSError:
        return None
    for m in re.finditer(r"(?im)^\s*WORKDIR\s+(\S+)\s*$", text):
        value = m.group(1).strip('"')
        if value.startswith("/") and "$" not in value:
            found = value
    return found


def _common(path: Path, source: Path, meta: dict[str, Any], instruction: str, fields: dict[str, str]) -> dict[str, Any]:
    """Validate what both layouts share; `fields` maps our names to the file's field names."""
    if not instruction.strip():
        raise TaskError(source, fields["instruction"], "the instruction is empty", "write what the agent must do")
    family = meta.get("category")
    if not isinstance(family, str) or not family.strip():
        raise TaskError(source, fields["category"], f"missing or not a string ({family!r})", 'add category = "<family>" (the task family f)')
    difficulty = meta.get("difficulty")
    if difficulty not in DIFFICULTIES:
        guess = difflib.get_close_matches(str(difficulty).strip().lower(), DIFFICULTIES, n=1, cutoff=0.6)
        raise TaskError(source, fields["difficulty"], f"got {difficulty!r}",
                        f"replace {_toml_repr(difficulty)} with " + (f'"{guess[0]}"' if guess else "")
                        + ("" if guess else f"one of {', '.join(DIFFICULTIES)}"))
    tags = meta.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise TaskError(source, fields["tags"], f"must be a list of strings, got {tags!r}",
                        f"replace tags = {_toml_repr(tags)} with a list of strings, e.g. tags = [{_toml_repr(str(tags))}]"
                        if not isinstance(tags, list) else 'write every tag as a string, e.g. tags = ["a", "b"]')
    return dict(task_id=path.name, path=path, instruction=instruction, family=family.strip(), difficulty=difficulty, tags=tuple(tags))


def _check_environment(path: Path, source: Path, env: dict[str, Any]) -> str:
    workdir = env.get("workdir")
    if workdir is None:  # a Dockerfile's last WORKDIR, as in its image, if the sandbox can use it
        workdir = DEFAULT_WORKDIR
        from_docker = dockerfile_workdir(path / "environment" / "Dockerfile")
        if from_docker and from_docker.strip("/") and not any(
                from_docker.rstrip("/") == r or from_docker.startswith(r + "/") or r.startswith(from_docker.rstrip("/") + "/")
                for r in _RESERVED_DIRS):
            workdir = from_docker
    if not isinstance(workdir, str) or not workdir.startswith("/") or workdir.rstrip("/") == "" or ".." in workdir.split("/"):
        raise TaskError(source, "environment.workdir", f"must be an absolute path other than /, got {workdir!r}",
                        f'replace workdir = {_toml_repr(workdir)} with an absolute path such as "/app"')
    workdir = "/" + workdir.strip("/")
    for reserved in _RESERVED_DIRS:
        if workdir == reserved or workdir.startswith(reserved + "/") or reserved.startswith(workdir + "/"):
            raise TaskError(source, "environment.workdir", f"{workdir} overlaps {reserved}, which the sandbox mounts itself",
                            f'replace workdir = "{workdir}" with a path outside {reserved}, such as "/app"')
    setup = env.get("setup")
    if setup is not None:
        if not isinstance(setup, str) or not (path / "environment" / setup).is_file() or ".." in Path(setup).parts:
            raise TaskError(source, "environment.setup", f"{setup!r} is not a file inside environment/",
                            f"put {setup!r} in environment/ and name it relative to it (setup = \"name.sh\")")
    for key in ("setup_timeout_sec", "memory_mb"):
        if key in env:
            _positive(source, f"environment.{key}", env[key], 1.0)
    if "memory" in env and "memory_mb" not in env:
        _parse_size_mb(source, "environment.memory", env["memory"])
    _check_pip_packages(source, env.get("pip_packages", []))
    if "runs_on_base" in env and not isinstance(env["runs_on_base"], bool):
        raise TaskError(source, "environment.runs_on_base", f"must be true or false, got {env['runs_on_base']!r}",
                        f"replace runs_on_base = {_toml_repr(env['runs_on_base'])} with true or false")
    return workdir


def _check_pip_packages(source: Path, packages: Any) -> None:
    fix = 'write requirement strings, e.g. pip_packages = ["numpy==2.3.0", "requests"]'
    if not isinstance(packages, list):
        raise TaskError(source, "environment.pip_packages", f"must be a list, got {_toml_repr(packages)}", fix)
    from packaging.requirements import InvalidRequirement, Requirement

    for spec in packages:
        try:
            if not isinstance(spec, str):
                raise InvalidRequirement("not a string")
            if Requirement(spec).url:
                raise InvalidRequirement("a URL: the index holds packages from an index")
        except InvalidRequirement as e:
            raise TaskError(source, "environment.pip_packages", f"{_toml_repr(spec)} is not a pip requirement ({str(e).splitlines()[0]})",
                            fix) from e


def _load_harbor(path: Path) -> Task:
    source = path / "task.toml"
    try:
        config = tomllib.loads(source.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(source, "(syntax)", f"not valid TOML ({e})", "fix the TOML syntax") from e
    instruction_md = path / "instruction.md"
    if not instruction_md.is_file():
        raise TaskError(instruction_md, "(file)", "missing", "write the agent's instruction in instruction.md")
    for section in ("metadata", "agent", "verifier", "environment"):
        if not isinstance(config.get(section, {}), dict):
            raise TaskError(source, f"[{section}]", "must be a table", f"write a [{section}] section")
    check_keys(source, config)
    meta = config.get("metadata", {})
    common = _common(path, source, meta, instruction_md.read_text(), {
        "instruction": "instruction.md", "category": "metadata.category",
        "difficulty": "metadata.difficulty", "tags": "metadata.tags"})
    test_sh = path / "tests" / "test.sh"
    if not test_sh.is_file():
        raise TaskError(test_sh, "(file)", "missing", "add tests/test.sh that runs pytest and writes /logs/verifier/reward.txt")
    env = config.get("environment", {})
    verifier_env = config.get("verifier", {}).get("env", {})
    if not isinstance(verifier_env, dict):
        raise TaskError(source, "verifier.env", "must be a table of strings", 'write env = { NAME = "value" }')
    agent_env = env.get("env", {}) if isinstance(env, dict) else {}
    if not isinstance(agent_env, dict) or any(isinstance(v, (dict, list)) for v in agent_env.values()):
        raise TaskError(source, "environment.env", "must be a table of strings",
                        'write [environment.env] with NAME = "value" lines')
    bad = [k for k in agent_env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k))]
    if bad:
        raise TaskError(source, "environment.env", f"{bad[0]!r} is not a variable name",
                        "use letters, digits and _ (not starting with a digit)")
    return Task(
        **common,
        agent_timeout_sec=_positive(source, "agent.timeout_sec", config.get("agent", {}).get("timeout_sec"), DEFAULT_AGENT_TIMEOUT_SEC),
        verifier_timeout_sec=_positive(source, "verifier.timeout_sec", config.get("verifier", {}).get("timeout_sec"), DEFAULT_VERIFIER_TIMEOUT_SEC),
        workdir=_check_environment(path, source, env),
        environment=dict(env),
        verifier_env={str(k): str(v) for k, v in verifier_env.items()},
        agent_env={str(k): str(v) for k, v in agent_env.items()},
        layout="harbor",
    )


def _load_tb1(path: Path) -> Task:
    source = path / "task.yaml"
    try:
        config = yaml.safe_load(source.read_text())
    except yaml.YAMLError as e:
        raise TaskError(source, "(syntax)", f"not valid YAML ({e})", "fix the YAML syntax") from e
    if not isinstance(config, dict):
        raise TaskError(source, "(top level)", "must be a mapping", "write instruction:, difficulty:, category: keys")
    instruction = config.get("instruction")
    if not isinstance(instruction, str):
        raise TaskError(source, "instruction", "missing", "add instruction: | ...")
    common = _common(path, source, config, instruction, {
        "instruction": "instruction", "category": "category", "difficulty": "difficulty", "tags": "tags"})
    if not (path / "run-tests.sh").is_file():
        raise TaskError(path / "run-tests.sh", "(file)", "missing", "add run-tests.sh that runs the tests in $TEST_DIR")
    return Task(
        **common,
        agent_timeout_sec=_positive(source, "max_agent_timeout_sec", config.get("max_agent_timeout_sec"), DEFAULT_AGENT_TIMEOUT_SEC),
        verifier_timeout_sec=_positive(source, "max_test_timeout_sec", config.get("max_test_timeout_sec"), DEFAULT_VERIFIER_TIMEOUT_SEC),
        workdir=DEFAULT_WORKDIR,
        environment={},
        verifier_env={"TEST_DIR": "/tests"},
        layout="tb1",
    )


def load_task(path: str | Path) -> Task:
    """Load and validate one task directory; raise TaskError naming file, field and fix."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise TaskError(path, "(directory)", "not a directory", "pass a task directory")
    if (path / "task.toml").is_file():
        return _load_harbor(path)
    if (path / "task.yaml").is_file():
        return _load_tb1(path)
    raise TaskError(path / "task.toml", "(file)", "missing", "add task.toml (Harbor layout) or task.yaml (Terminal-Bench 1)")


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "task.yaml").is_file() or (path / "instruction.md").is_file()


def load_tasks(root: str | Path) -> tuple[list[Task], list[TaskError]]:
    """Load every task under `root` (itself a task, or a directory of tasks).

    Returns the good tasks (sorted by id) and one TaskError per bad one; never raises for a
    bad task, so one broken directory does not hide a suite.
    """
    root = Path(root)
    if not root.is_dir():
        raise TaskError(root, "(directory)", "does not exist", "pass a task directory or a directory of tasks")
    candidates = [root] if is_task_dir(root) else sorted(p for p in root.iterdir() if p.is_dir() and is_task_dir(p))
    tasks, errors = [], []
    for path in candidates:
        try:
            tasks.append(load_task(path))
        except TaskError as e:
            logger.warning("%s", e)
            errors.append(e)
    return tasks, errors
