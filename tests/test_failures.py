"""The failure taxonomy: one hand-made episode per category on a real toy task's metadata."""

from __future__ import annotations

import pytest

from minirsi.core.episode import Episode
from minirsi.run import failures

# A toy task of two steps: "Write plum to cat.txt." (cat.txt is there read-only) and
# "Copy dog.txt to fox.txt." (no obstacle); what toy_envs writes to solution/toy.json.
META = {
    "canonical": ["echo plum > cat.txt", "cp dog.txt fox.txt"],
    "obstacles": [{"kind": "read_only", "command": "echo plum > cat.txt",
                   "error": "bash: line 9: cat.txt: Permission denied", "exit_code": 1,
                   "fix": ["chmod u+w cat.txt"], "redo": "echo plum > cat.txt"}],
}
DENIED = "bash: line 8: cat.txt: Permission denied\n[exit 1]"  # the agent wrote no comment: line 8


def _ep(turns, success=False, stop="done", parse_errors=0):
    transcript = [{"commands": [c] if c else [], "observation": o} for c, o in turns]
    n = len(turns)
    return Episode("files-medium-x", "files", "medium", [1], [None], [1], [0], n, success, 0, 5,
                   stop_reason=stop, parse_errors=parse_errors, transcript=transcript)


CASES = [
    ("format", _ep([(None, "No command found."), (None, "No command found.")], parse_errors=2)),
    ("turn_limit", _ep([("ls", "cat.txt\n[exit 0]")] * 3, stop="max_turns")),
    ("wrong_name", _ep([("chmod u+w cat.txt", "[exit 0]"), ("echo plum > cat.txt", "[exit 0]"),
                        ("cp dog.txt owl.txt", "[exit 0]")])),
    ("obstacle", _ep([("echo plum > cat.txt", DENIED), ("cp dog.txt fox.txt", "[exit 0]")])),
    ("obstacle", _ep([("echo plum > cat.txt", DENIED), ("echo plum > cat.txt", DENIED),
                      ("cp dog.txt fox.txt", "[exit 0]")])),  # repeating it is no fix
    ("obstacle", _ep([("# Write plum to cat.txt.\necho plum > cat.txt", "bash: line 9: cat.txt: Permission denied\n[exit 1]"),
                      ("# Copy dog.txt to fox.txt.\ncp dog.txt fox.txt", "[exit 0]")])),  # the demonstrator's blocks
    ("stopped_early", _ep([("echo plum > cat.txt", DENIED), ("chmod u+w cat.txt", "[exit 0]"),
                           ("echo plum > cat.txt", "[exit 0]")])),
    ("other", _ep([("chmod u+w cat.txt", "[exit 0]"), ("echo plum > cat.txt", "[exit 0]"),
                   ("cp dog.txt fox.txt", "[exit 0]"), ("touch notes.txt", "[exit 0]")])),
]


@pytest.mark.parametrize("want,ep", CASES, ids=[f"{w}-{i}" for i, (w, _) in enumerate(CASES)])
def test_each_category(want, ep):
    assert failures.classify(ep, META) == want


def test_a_success_has_no_category_and_a_wrong_name_fixed_later_is_not_one():
    ok = _ep([("cp dog.txt fox.txt", "[exit 0]")], success=True)
    assert failures.classify(ok, META) is None
    retried = _ep([("chmod u+w cat.txt", "[exit 0]"), ("echo plum > cat.txt", "[exit 0]"),
                   ("cp owl.txt fox.txt", "cp: cannot stat 'owl.txt': No such file or directory\n[exit 1]"),
                   ("cp dog.txt fox.txt", "[exit 0]"), ("touch x", "[exit 0]")])
    assert failures.classify(retried, META) == "other"


def test_a_task_without_toy_metadata_gets_the_generic_categories(tmp_path):
    assert failures.classify(CASES[3][1], None) == "other"
    assert failures.classify(CASES[1][1], None) == "turn_limit"
    s = failures.summarise([CASES[0][1], CASES[3][1], _ep([("ls", "[exit 0]")], success=True)],
                           {"files-medium-x": tmp_path})  # no solution/toy.json there
    assert s["n_failed"] == 2 and s["counts"]["format"] == 1 and s["counts"]["other"] == 1


def test_shape_hides_names_only():
    assert failures.shape("cp cat.txt red/") == "cp N.txt N/"
    assert failures.shape("chmod u+w plum.txt") == "chmod u+w N.txt"
