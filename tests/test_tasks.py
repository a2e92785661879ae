"""Task loading: the Harbor / TB2 layout, the TB1 layout, and errors that name file, field, fix."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirsi.env.tasks import DIFFICULTIES, Task, TaskError, _parse_size_mb, load_task, load_tasks

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"


def test_harbor_task_fields():
    task = load_task(FIXTURES / "good" / "hello")
    assert task.task_id == "hello"
    assert task.family == "files" and task.difficulty == "easy" and task.tags == ("fixture",)
    assert task.agent_timeout_sec == 60.0 and task.verifier_timeout_sec == 30.0
    assert task.workdir == "/app" and task.layout == "harbor"
    assert task.instruction.startswith("Write the word")
    assert task.test_script.name == "test.sh" and task.solution_script.name == "solve.sh"
    assert task.dockerfile is None and task.setup_script is None


def test_setup_and_custom_workdir():
    task = load_task(FIXTURES / "good" / "with_setup")
    assert task.workdir == "/home/agent/project"
    assert task.setup_script == task.path / "environment" / "setup.sh"


def test_tb1_layout():
    task = load_task(FIXTURES / "good" / "tb1_task")
    assert task.layout == "tb1" and task.family == "files" and task.agent_timeout_sec == 60
    assert task.test_script.name == "run-tests.sh" and task.solution_script.name == "solution.sh"
    assert task.verifier_env == {"TEST_DIR": "/tests"}


def test_dockerfile_is_seen():
    task = load_task(FIXTURES / "docker_only" / "with_dockerfile")
    assert task.dockerfile is not None and task.memory_mb == 1024


EXPECTED_ERRORS = {
    "bad_difficulty": ("task.toml", "metadata.difficulty"),
    "bad_toml": ("task.toml", "(syntax)"),
    "no_category": ("task.toml", "metadata.category"),
    "no_test_sh": ("test.sh", "(file)"),
    "bad_workdir": ("task.toml", "environment.workdir"),
    "bad_timeout": ("task.toml", "agent.timeout_sec"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_malformed_task_names_file_field_and_fix(name):
    file_name, field_name = EXPECTED_ERRORS[name]
    with pytest.raises(TaskError) as info:
        load_task(FIXTURES / "malformed" / name)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.path.name == file_name and err.field_name == field_name
    assert file_name in str(err) and field_name in str(err) and "Fix:" in str(err)


def test_load_tasks_keeps_good_and_reports_bad(tmp_path):
    for src in ["good/hello", "good/with_setup", "malformed/bad_toml", "malformed/no_category"]:
        shutil.copytree(FIXTURES / src, tmp_path / Path(src).name)
    (tmp_path / "not_a_task").mkdir()  # ignored: no task files
    tasks, errors = load_tasks(tmp_path)
    assert [t.task_id for t in tasks] == ["hello", "with_setup"]
    assert sorted(e.path.parent.name for e in errors) == ["bad_toml", "no_category"]


def test_load_tasks_on_a_single_task_dir():
    tasks, errors = load_tasks(FIXTURES / "good" / "hello")
    assert [t.task_id for t in tasks] == ["hello"] and errors == []


def test_missing_instruction(tmp_path):
    shutil.copytree(FIXTURES / "good" / "hello", tmp_path / "t")
    (tmp_path / "t" / "instruction.md").unlink()
    with pytest.raises(TaskError, match="instruction.md"):
        load_task(tmp_path / "t")


@pytest.mark.parametrize("line, field_name", [
    ('workdir = "/tests/x"', "environment.workdir"),
    ('workdir = "/"', "environment.workdir"),
    ('setup = "nope.sh"', "environment.setup"),
    ('memory = "lots"', "environment.memory"),
    ("runs_on_base = 1", "environment.runs_on_base"),
    ('workdir = "/app"\nenv = "X=1"', "environment.env"),
    ('workdir = "/app"\nenv = { X = { y = 1 } }', "environment.env"),
    ('workdir = "/app"\nenv = { "1X" = "a" }', "environment.env"),
])
def test_bad_environment_fields(tmp_path, line, field_name):
    shutil.copytree(FIXTURES / "good" / "hello", tmp_path / "t")
    toml = tmp_path / "t" / "task.toml"
    toml.write_text(toml.read_text().replace('workdir = "/app"', line))
    with pytest.raises(TaskError) as info:
        load_task(tmp_path / "t")
    assert info.value.field_name == field_name


def test_environment_env_is_read(tmp_path):
    shutil.copytree(FIXTURES / "good" / "hello", tmp_path / "t")
    toml = tmp_path / "t" / "task.toml"
    toml.write_text(toml.read_text() + '\n[environment.env]\nGIT_AUTHOR_DATE = "2026-01-01T00:00:00+0000"\nN = 3\n')
    task = load_task(tmp_path / "t")
    assert task.agent_env == {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000", "N": "3"}
    assert load_task(FIXTURES / "good" / "hello").agent_env == {}


def test_task_is_frozen():
    task = load_task(FIXTURES / "good" / "hello")
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'family'"):
        task.family = "other"  # type: ignore[misc]
    assert isinstance(task, Task) and task.family == "files"


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=12).filter(lambda s: s not in DIFFICULTIES and '"' not in s and "\\" not in s
                                                 and all(c.isprintable() for c in s)))
def test_any_unknown_difficulty_is_rejected(tmp_path_factory, difficulty):
    d = tmp_path_factory.mktemp("t")
    shutil.copytree(FIXTURES / "good" / "hello", d / "t")
    toml = d / "t" / "task.toml"
    toml.write_text(toml.read_text().replace('difficulty = "easy"', f'difficulty = "{difficulty}"'))
    with pytest.raises(TaskError, match="metadata.difficulty"):
        load_task(d / "t")


@given(st.integers(1, 10_000), st.sampled_from(["M", "G", "Mb", "gb", "m"]))
def test_size_parsing(n, unit):
    mb = _parse_size_mb(Path("task.toml"), "environment.memory", f"{n}{unit}")
    assert mb == (n * 1024 if unit.lower().startswith("g") else n)


@pytest.mark.parametrize("edit, field_name, fix", [
    (("[environment]", "[enviroment]"), "[enviroment]", "rename [enviroment] to [environment]"),
    (('difficulty = "easy"', 'dificulty = "easy"\ndifficulty = "easy"'), "metadata.dificulty",
     "rename dificulty to difficulty under [metadata]"),
    (('workdir = "/app"', 'workdir = "/app"\nrun_on_base = true'), "environment.run_on_base",
     "rename run_on_base to runs_on_base under [environment]"),
    (("timeout_sec = 60.0", "timeout_sec = -5"), "agent.timeout_sec", "replace timeout_sec = -5 under [agent] with a "
     "positive number, e.g. timeout_sec = 5"),
    (("timeout_sec = 60.0", 'timeout_sec = "10m"'), "agent.timeout_sec", 'replace timeout_sec = "10m"'),
    (('difficulty = "easy"', 'difficulty = "Hard"'), "metadata.difficulty", 'replace "Hard" with "hard"'),
    (("[agent]", "[agent]\nmax_turns = 3"), "agent.max_turns", "remove max_turns from [agent] (known: timeout_sec"),
    (('workdir = "/app"', 'workdir = "/tests/x"'), "environment.workdir", 'replace workdir = "/tests/x" with a path'),
    (('workdir = "/app"', 'workdir = "app"'), "environment.workdir", 'replace workdir = "app" with an absolute path'),
    (('workdir = "/app"', 'memory = "lots"'), "environment.memory", 'replace memory = "lots" with a size'),
    (('tags = ["fixture"]', 'tags = "fixture"'), "metadata.tags", 'replace tags = "fixture" with a list of strings, '
     'e.g. tags = ["fixture"]'),
])
def test_unknown_keys_and_bad_values_name_the_fix(tmp_path, edit, field_name, fix):
    shutil.copytree(FIXTURES / "good" / "hello", tmp_path / "t")
    toml = tmp_path / "t" / "task.toml"
    toml.write_text(toml.read_text().replace(*edit, 1))
    with pytest.raises(TaskError) as info:
        load_task(tmp_path / "t")
    assert info.value.field_name == field_name and fix in str(info.value), str(info.value)


def test_free_form_metadata_and_harbor_schema_keys_load(tmp_path):
    shutil.copytree(FIXTURES / "good" / "hello", tmp_path / "t")
    toml = tmp_path / "t" / "task.toml"
    toml.write_text('schema_version = "1.1"\nartifacts = []\n[task]\nname = "x/hello"\nkeywords = ["a"]\n'
                    + toml.read_text().replace("[metadata]", '[metadata]\nsource_url = "https://example.com"')
                    + "\ngpus = 0\nallow_internet = false\nmcp_servers = []\n[solution.env]\n")
    assert load_task(tmp_path / "t").task_id == "t"


def test_dockerfile_workdir_is_the_default_workdir(tmp_path):
    shutil.copytree(FIXTURES / "tb2" / "word-stats", tmp_path / "t")
    df = tmp_path / "t" / "environment" / "Dockerfile"
    df.write_text(df.read_text() + "WORKDIR /srv/site\n")
    assert load_task(tmp_path / "t").workdir == "/srv/site"
    toml = tmp_path / "t" / "task.toml"
    toml.write_text(toml.read_text() + 'workdir = "/app"\n')  # task.toml wins
    assert load_task(tmp_path / "t").workdir == "/app"
