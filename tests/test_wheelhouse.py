"""The package index inside the jail (minirsi/env/wheelhouse.py): which packages a task's files name,
the task.toml field, the layer key and environment, and what the verifier is shown. Fast: no
sandbox, no network (the preparation and episodes on a prepared index are in test_layers.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from minirsi.env.layers import Layer
from minirsi.env.tasks import TaskError, load_task
from minirsi.env.wheelhouse import INDEX_DIR, index_env, index_key, read_index_specs, verifier_overlays

WORD_STATS = Path(__file__).parent / "fixtures" / "tasks" / "tb2" / "word-stats"


def _task(tmp_path: Path, solve: str = "", tests: dict[str, str] | None = None, instruction: str | None = None,
          toml_extra: str = "", env_files: dict[str, str] | None = None):
    d = tmp_path / "t"
    shutil.copytree(WORD_STATS, d)
    if solve:
        (d / "solution" / "solve.sh").write_text(solve)
    for name, text in (tests or {}).items():
        (d / "tests" / name).write_text(text)
    for name, text in (env_files or {}).items():
        (d / "environment" / name).write_text(text)
    if instruction is not None:
        (d / "instruction.md").write_text(instruction)
    if toml_extra:
        toml = d / "task.toml"
        toml.write_text(toml.read_text() + toml_extra)
    return load_task(d)


def test_the_fixture_names_no_package():
    # word-stats' test.sh installs its tools with uvx -w, which is the tools layer's, not the index's
    assert read_index_specs(load_task(WORD_STATS)) == ()


def test_every_install_form_in_solve_sh_is_one_group(tmp_path):
    solve = ("#!/bin/bash\nset -e\npip install eigenpy==3.10.3\n"
             "pip3 install --break-system-packages \"scipy==1.16.1\" -q\n"
             "python3 -m pip install -U numpy 'pandas<3' && echo done\n"
             "sudo -E python -u -m pip install --index-url https://mirror.example/simple requests[socks]\n"
             "uv pip install --system polars; uv add 'httpx>=0.27'\n"
             "/usr/local/bin/pip install \\\n    rich==13.7.1 \\\n    click\n"
             "pip install -r requirements.txt -c constraints.txt\n"
             # not looked up in an index: a path, a URL, a variable, an editable, a wheel file
             "pip install -e . ./pkg git+https://github.com/x/y.git $EXTRA dist/a-1.0-py3-none-any.whl\n"
             "echo pip install not-a-command  # a word in an argument\n"
             "pip download tqdm; pip list\n")
    task = _task(tmp_path, solve=solve, env_files={"requirements.txt": "# pinned\nattrs==25.3.0  # why\n-e .\n"})
    assert read_index_specs(task) == (
        ("attrs==25.3.0",), ("click", "rich==13.7.1"), ("eigenpy==3.10.3",), ("httpx>=0.27",),
        ("numpy", "pandas<3"), ("polars",), ("requests[socks]",), ("scipy==1.16.1",))


def test_tests_instruction_and_task_toml_add_groups(tmp_path):
    tests = {"test_outputs.py": "import subprocess, sys\n\n\ndef test_x():\n"
                                "    subprocess.run([sys.executable, '-m', 'pip', 'install', 'pyyaml==6.0.2'])\n"
                                "    subprocess.run('pip install toml', shell=True)\n"
                                "    # pip install in-a-comment: not a command\n",
             "test.sh": "#!/bin/bash\npip install pytest==8.4.1 --break-system-packages\npython -m pytest /tests\n"}
    instruction = ("Speed it up. You may `pip install numba` or:\n\n```bash\npython -m pip install cython==3.1.2\n```\n"
                   "Do not pip install anything else.\n")
    task = _task(tmp_path, tests=tests, instruction=instruction,
                 toml_extra='pip_packages = ["requests==2.32.5", "Scipy>=1.15"]\n')
    assert read_index_specs(task) == (("Scipy>=1.15", "requests==2.32.5"), ("cython==3.1.2",), ("numba",),
                                      ("pytest==8.4.1",), ("pyyaml==6.0.2",), ("toml",))


@pytest.mark.parametrize("value, words", [
    ('"numpy"', "must be a list"),
    ('["numpy=>2"]', '"numpy=>2" is not a pip requirement'),
    ('[3]', "3 is not a pip requirement"),
    ('["pkg @ https://example.com/pkg.whl"]', "a URL"),
])
def test_a_bad_pip_packages_field_names_the_field_and_the_fix(tmp_path, value, words):
    with pytest.raises(TaskError, match=rf"task.toml: environment.pip_packages: .*{words}.*Fix: write requirement"):
        _task(tmp_path, toml_extra=f"pip_packages = {value}\n")


def test_the_key_follows_the_environment_and_the_groups():
    a = index_key("env1", (("eigenpy==3.10.3",),))
    assert a == index_key("env1", (("eigenpy==3.10.3",),))
    assert len({a, index_key("env2", (("eigenpy==3.10.3",),)), index_key("env1", (("eigenpy==3.10.2",),)),
                index_key("env1", (("eigenpy==3.10.3", "numpy"),))}) == 4


def test_pip_and_uv_see_only_the_index():
    assert index_env(None) == {"PIP_NO_INDEX": "1", "UV_OFFLINE": "1"}  # fails at once, no network retries
    index = Layer("k", Path("/nonexistent"))
    assert index_env(index) == {"PIP_NO_INDEX": "1", "UV_OFFLINE": "1", "PIP_FIND_LINKS": INDEX_DIR,
                                "UV_FIND_LINKS": INDEX_DIR}


def test_the_verifier_is_shown_the_indexs_copies_of_what_the_episode_installed(tmp_path):
    layer = tmp_path / "index"
    layer.mkdir()
    wheels = [{"file": "eigenpy-3.10.3-0-cp311-cp311-manylinux_2_28_x86_64.whl", "site": 0,
               "dist_info": ["eigenpy-3.10.3.dist-info"]},
              {"file": "cmeel-0.62.0-py3-none-any.whl", "site": 1, "dist_info": ["cmeel-0.62.0.dist-info"]},
              {"file": "numpy-2.3.5-cp311-cp311-manylinux_2_28_x86_64.whl", "site": 2,
               "dist_info": ["numpy-2.3.5.dist-info"]}]
    (layer / "meta.json").write_text(json.dumps({"wheels": wheels}))
    upper = tmp_path / "upper"
    for d in ("usr/local/lib/python3.11/dist-packages/eigenpy-3.10.3.dist-info",
              "usr/local/lib/python3.11/dist-packages/cmeel-0.62.0.dist-info",
              "usr/local/lib/python3.11/dist-packages/numpy-2.3.4.dist-info",  # another version: not the index's
              "usr/local/lib/python3.11/dist-packages/forged-1.0.dist-info",  # not in the index
              "app/.venv/lib/python3.11/site-packages/numpy-2.3.5.dist-info"):  # not pinned: seen as it is
        (upper / d).mkdir(parents=True)
    pins = ["bin", "usr/lib/python3", "usr/lib/python3.11", "usr/local/lib/python3.11"]
    assert verifier_overlays(Layer("k", layer), upper, pins) == [
        ("usr/local/lib/python3.11/dist-packages", layer / "upper/opt/minirsi-site", ["0", "1"])]
    assert verifier_overlays(Layer("k", layer), upper, ["bin"]) == []
