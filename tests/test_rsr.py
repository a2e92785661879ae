"""RSR: transcript cleaning, the replay minimiser, the action-only SFT loss, the config, and
(slow, real bwrap sandboxes + the verifier) a stage that makes a tiny actor succeed more often,
trains only on re-verified rewrites, and leaves the critic bit-identical."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from minirsi.core.rsr import (
    Replay,
    ReplayMinimiser,
    RSRConfig,
    Step,
    clean_transcript,
    sft_loss,
)
from tiny import VOCAB, tiny_qwen


# ----------------------------------------------------------------------------- cleaning


def test_clean_transcript_drops_failures_noise_and_repeats():
    transcript = [
        {"commands": ["ls /app"], "observation": "a.txt\n[exit 0]"},
        {"commands": [], "observation": "No command found. ..."},  # a format error: ran nothing
        {"commands": ["cat nope"], "observation": "cat: nope: No such file or directory\n[exit 1]"},
        {"commands": ["mkdir out", "cp a.txt out/"], "observation": "[exit 0]\n[exit 0]"},
        {"commands": ["cp a.txt out/"], "observation": "[exit 0]"},  # consecutive repeat
        {"commands": ["ls /app"], "observation": "a.txt\nout\n[exit 0]"},  # read-only, seen before
        {"commands": ["sleep 99"], "observation": "[timed out]"},
        {"commands": ["echo x >> log"], "observation": None},  # the sandbox died
        {"commands": ["gzip out/a.txt", "bogus"], "observation": "[exit 0]\nbash: bogus: command not found\n[exit 127]"},
        {"commands": [], "observation": "", "action": "TASK_COMPLETE"},
    ]
    steps = clean_transcript(transcript)
    assert [s.command for s in steps] == ["ls /app", "mkdir out", "cp a.txt out/", "gzip out/a.txt"]
    assert steps[0].output == "a.txt"


def test_clean_keeps_repeated_writes_that_are_not_consecutive():
    transcript = [{"commands": ["echo a >> f"], "observation": "[exit 0]"},
                  {"commands": ["echo b >> f"], "observation": "[exit 0]"},
                  {"commands": ["echo a >> f"], "observation": "[exit 0]"}]
    assert len(clean_transcript(transcript)) == 3


def _recovery_transcript(session):
    """A corpus session as an Episode's transcript: one block per turn, the observation the
    harness would have shown (actions.format_observation), then TASK_COMPLETE."""
    from minirsi.core import actions

    turns = [{"commands": [t.commands], "observation": actions.format_observation(
        [SimpleNamespace(output=t.output, exit_code=t.exit_code, timed_out=False, truncated=False)])}
        for t in session.turns]
    return turns + [{"commands": [], "observation": None, "action": "TASK_COMPLETE"}]


def _sandbox_ready() -> bool:
    import shutil
    from pathlib import Path

    from minirsi.env.sandbox.bwrap import default_rootfs

    return shutil.which("bwrap") is not None and (Path(default_rootfs()) / "usr/bin/python3").exists()


@pytest.mark.skipif(not _sandbox_ready(), reason="bwrap or the sandbox rootfs is missing (scripts/setup.sh)")
def test_cleaning_keeps_a_recovered_failure_and_both_cleanings_reverify(tmp_path):
    """A run that met each obstacle, read the error, fixed it and ran the command again.
    By default (keep_recovered) the failed attempt stays, its error in its output, before the
    fix and the same command again: the fix is trained where its cause shows. A ``-f`` redo is
    another command, so that failure goes and the run starts with the ``-f`` form. With
    keep_recovered=False every failure goes: the fix first, the command once (recover-first).
    Both rewrites pass the verifier in a fresh sandbox."""
    import random

    from minirsi.engine.rollout import make_replay_fn
    from minirsi.env.tasks import load_task
    from toy_envs import corpus, obstacles
    from toy_envs.base import write_task
    from toy_envs.suites import suite_instances

    tmp_path.chmod(0o755)
    picked: dict[str, object] = {}
    for inst in suite_instances("train", n=300):
        kinds = {st.obstacle.kind for st in inst.steps if st.obstacle is not None}
        if len(kinds) == 1:  # one kind of obstacle in the instance
            picked.setdefault(kinds.pop(), inst)
    assert set(picked) == set(obstacles.OBSTACLES)
    replay = make_replay_fn()
    for kind, inst in picked.items():
        s = corpus.session_for(inst, random.Random(0), choices={"obstacle": "recover", "stop_early": False,
                                                               "retry": False})
        assert any(t.exit_code != 0 for t in s.turns)  # it did meet the obstacle
        task = load_task(write_task(inst, tmp_path))
        transcript = _recovery_transcript(s)
        recover_first = [step.command for step in clean_transcript(transcript, keep_recovered=False)]
        # the oracle's commands, each step's after the command that printed its line
        assert [c.split("\n")[-1] for c in recover_first] == inst.clean_run, kind
        kept = clean_transcript(transcript)
        if all(st.obstacle.redo is None for st in inst.steps if st.obstacle is not None):
            # the failed attempt, its fix and the command again: the session's own commands
            assert [st.command.split("\n")[-1] for st in kept] == [t.command for t in s.turns], kind
            failed = next(t for t in s.turns if t.exit_code != 0)
            assert any(st.output == failed.output.rstrip("\n") for st in kept), kind  # its error stays
        else:  # needs_force: the -f form is another command, so the run cleans to recover-first
            assert [st.command for st in kept] == recover_first, kind
        for commands in (recover_first, [st.command for st in kept]):
            assert replay(task, commands).success, kind


def test_a_failure_followed_by_its_own_success_is_not_a_recovery():
    """Nothing ran between the two attempts, so the failure answered nothing: one block stays.
    A failure never run again (a wrong name, a dead end) goes either way."""
    transcript = [
        {"commands": ["cp a.txt b.txt"], "observation": "cp: busy\n[exit 1]"},
        {"commands": ["cp a.txt b.txt"], "observation": "[exit 0]"},
        {"commands": ["cat dog.txt"], "observation": "cat: dog.txt: No such file or directory\n[exit 1]"},
        {"commands": ["./run.sh"], "observation": "bash: ./run.sh: Permission denied\n[exit 126]"},
        {"commands": ["./run.sh"], "observation": "bash: ./run.sh: Permission denied\n[exit 126]"},  # a repeat
        {"commands": ["chmod +x run.sh"], "observation": "[exit 0]"},
        {"commands": ["# 3. Run run.sh.\n./run.sh"], "observation": "ok\n[exit 0]"},  # comment lines aside
    ]
    steps = clean_transcript(transcript)
    assert [s.command for s in steps] == ["cp a.txt b.txt", "./run.sh", "chmod +x run.sh", "# 3. Run run.sh.\n./run.sh"]
    assert [s.output for s in steps] == ["", "bash: ./run.sh: Permission denied", "", "ok"]
    assert [s.command for s in clean_transcript(transcript, keep_recovered=False)] == [
        "cp a.txt b.txt", "chmod +x run.sh", "# 3. Run run.sh.\n./run.sh"]


# ----------------------------------------------------------------------------- minimiser


class FakeReplay:
    """Passes when every required command was run, in order (extra commands are harmless)."""

    def __init__(self, required):
        self.required, self.calls = list(required), 0

    def __call__(self, task, commands):
        self.calls += 1
        it = iter(commands)
        ok = all(any(c == r for c in it) for r in self.required)
        return Replay(list(commands), [""] * len(commands), [0] * len(commands), ok, int(ok), 1)


def test_replay_minimiser_drops_every_unneeded_command():
    replay = FakeReplay(["mkdir out", "cp a out/"])
    cleaned = [Step(c, "") for c in ["ls", "mkdir out", "pwd", "cp a out/", "ls out"]]
    out = ReplayMinimiser(replay).rewrite(SimpleNamespace(task_id="t"), cleaned)
    assert out == ["mkdir out", "cp a out/"]
    assert replay.calls == len(cleaned) + 1


def test_replay_minimiser_returns_a_broken_run_unchanged():
    replay = FakeReplay(["never run"])
    cleaned = [Step("ls", ""), Step("pwd", "")]
    assert ReplayMinimiser(replay).rewrite(SimpleNamespace(task_id="t"), cleaned) == ["ls", "pwd"]
    assert replay.calls == 1


# ----------------------------------------------------------------------------- SFT loss


def test_sft_loss_reads_action_tokens_only():
    """Changing prompt/observation targets changes nothing but the context of later tokens;
    changing padding (right of the sequence) changes nothing at all."""
    model = tiny_qwen()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    att = torch.ones(2, 12, dtype=torch.long)
    att[1, 9:] = 0
    act = torch.zeros(2, 12)
    act[0, 4:7] = 1
    act[1, 3:9] = 1
    base = sft_loss(model, ids, att, act)
    ids2 = ids.clone()
    ids2[1, 9:] = torch.randint(1, VOCAB, (3,), generator=g)  # padding
    ids2[0, 7:] = torch.randint(1, VOCAB, (5,), generator=g)  # after the last action token of row 0
    assert torch.allclose(sft_loss(model, ids2, att, act), base, atol=1e-6)
    # hand check against the model's own loss on one row with labels = -100 off-action
    labels = torch.where(act[0].bool(), ids[0], torch.tensor(-100))[None]
    ref = model(input_ids=ids[:1], labels=labels).loss
    assert torch.allclose(sft_loss(model, ids[:1], att[:1], act[:1]), ref, atol=1e-5)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="'llm' or 'replay'"):
        RSRConfig(planner="oracle")
    with pytest.raises(ValueError, match="samples_per_task"):
        RSRConfig(samples_per_task=0)


def test_the_run_config_rejects_an_unknown_replay_backend():
    """RSRConfig (core) does not know the sandbox backends; the run config checks rsr1's and rsr2's."""
    from minirsi.run.config import RunConfig

    RunConfig(rsr1=RSRConfig(backend="docker"))
    with pytest.raises(ValueError, match=r"RSRConfig.backend='podman': use one of \('bwrap', 'docker'\)"):
        RunConfig(rsr2=RSRConfig(backend="podman"))


def test_llm_planner_prompt_holds_task_and_cleaned_run_and_parses_commands():
    from minirsi.core.rsr import LLMPlanner
    from minirsi.engine.sampler import Sample

    class Scripted:  # a sampler that always answers with one bash block
        def __init__(self, tok):
            self.tok, self.prompts = tok, []

        def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seed=None):
            self.prompts += prompts
            ids = self.tok("```bash\necho hi > /app/out.txt\n```", add_special_tokens=False)["input_ids"]
            return [Sample(list(ids) + [stop_token_ids[0]], [0.0] * (len(ids) + 1), "stop") for _ in prompts]

    world_tok = _tokenizer(["Write hi into /app/out.txt", "echo hi > /app/out.txt", "ls /app"])
    sampler = Scripted(world_tok)
    planner = LLMPlanner(None, world_tok, sampler=sampler)
    task = SimpleNamespace(task_id="t", instruction="Write hi into /app/out.txt")
    cleaned = [Step("ls /app", "a.txt"), Step("echo hi > /app/out.txt", "")]
    text = planner.prompt_text(task, cleaned)
    assert task.instruction in text and "$ ls /app\na.txt" in text and "$ echo hi > /app/out.txt" in text
    assert planner.rewrite(task, cleaned) == ["echo hi > /app/out.txt"]
    assert text in world_tok.decode(sampler.prompts[0])  # the planner sees exactly that message


def _tokenizer(texts):
    from minirsi.core import actions
    from minirsi.engine.models import build_tokenizer

    return build_tokenizer([actions.SYSTEM_PROMPT, *texts], vocab_size=300)


# ----------------------------------------------------------------------------- end to end
#
# A toy world small enough to train in seconds: two tasks ("write the word W into
# /app/out.txt", W in {hello, world}) in real bwrap sandboxes checked by the real verifier, and
# a tiny Qwen3 (hidden 64, 2 layers, a 300-token BPE) first fine-tuned on a 50/50 mixture of
# right and wrong sessions (the other task's word; half of them with a needless `ls /app`
# first), so it succeeds about 40% of the time. test_rpr.py imports toy_world from here.

WORDS = ("hello", "world")
_TOML = ('version = "1.0"\n[metadata]\ndifficulty = "easy"\ncategory = "files"\ntags = []\n'
         '[agent]\ntimeout_sec = 60.0\n[verifier]\ntimeout_sec = 30.0\n[environment]\nworkdir = "/app"\n')
_TEST_SH = ("#!/bin/bash\ncd /app\npytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml "
            "/tests/test_outputs.py -rA\n"
            "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")


def _write_task(root, word):
    from minirsi.env.tasks import load_task

    d = root / f"write-{word}"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "instruction.md").write_text(f"Write the word `{word}` into /app/out.txt.\n")
    (d / "task.toml").write_text(_TOML)
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\necho {word} > /app/out.txt\n")
    (d / "tests" / "test.sh").write_text(_TEST_SH)
    (d / "tests" / "test_outputs.py").write_text(  # two checks: P = 1 for the wrong word, 2 for the right one
        "from pathlib import Path\n\n\ndef test_exists():\n    assert Path('/app/out.txt').exists()\n\n\n"
        f"def test_content():\n    assert Path('/app/out.txt').read_text().strip() == '{word}'\n")
    return load_task(d)


def toy_world(root, seed: int = 0):
    from minirsi.core import actions
    from minirsi.core.rsr import sft
    from minirsi.engine.rollout import RolloutConfig
    from minirsi.engine.rollout import make_rollout_fn

    tasks = [_write_task(root, w) for w in WORDS]
    sessions = []
    for t in tasks:
        for w in WORDS:
            write = SimpleNamespace(commands=[f"echo {w} > /app/out.txt"], output="", exit_code=0)
            ls = SimpleNamespace(commands=["ls /app"], output="", exit_code=0)
            sessions += [SimpleNamespace(instruction=t.instruction, turns=turns) for turns in ([write], [ls, write])]
    texts = [t.instruction for t in tasks] + [x for s in sessions for turn in actions.session_turns(s) for x in turn if x]
    tok = _tokenizer(texts)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(seed)
    actor = Qwen3ForCausalLM(cfg)
    examples = [actions.render_session(tok, s)[:2] for s in sessions]
    # 40 steps at a high rate: enough to learn the format, not which word goes with which task
    sft(actor, examples * 4, RSRConfig(lr=1e-2, epochs=10, batch_size=8, seed=seed), tok.pad_token_id)
    rollout_cfg = RolloutConfig(max_turns=3, max_new_tokens=40, concurrency=16, temperature=1.0,
                                max_context_tokens=512)
    return SimpleNamespace(tasks=tasks, tok=tok, actor=actor,
                           rollout_fn=make_rollout_fn(tok, rollout_cfg, progress=False))


def _success(world, seed):
    eps = world.rollout_fn(world.actor, [t for t in world.tasks for _ in range(16)], seed)
    return sum(e.success for e in eps) / len(eps)


@pytest.mark.slow
def test_rsr_raises_success_on_verified_rewrites_only_and_leaves_the_critic(tmp_path):
    from minirsi.core.critic import build_critic, fingerprint, load_critic, save_critic
    from minirsi.core.rsr import run_rsr
    from minirsi.engine.rollout import make_replay_fn

    world = toy_world(tmp_path / "tasks")
    critic = build_critic(world.actor)  # a critic built from the actor, as the recipe does
    save_critic(critic, tmp_path / "critic")
    before_hash = fingerprint(critic)
    files = {p: p.read_bytes() for p in (tmp_path / "critic").rglob("*") if p.is_file()}

    replays = []
    real = make_replay_fn("bwrap", command_timeout=10.0)

    def spy(task, commands):
        r = real(task, commands)
        replays.append((task.task_id, tuple(commands), r.success))
        return r

    cfg = RSRConfig(samples_per_task=16, planner="replay", lr=3e-3, epochs=10, batch_size=4, seed=0)
    stats = run_rsr(world.actor, world.tok, world.tasks, cfg, world.rollout_fn, replay_fn=spy)  # the replay planner

    before = stats.runs_verified / stats.runs_sampled
    assert 0.1 < before < 0.8, stats  # the actor sometimes succeeds
    passing = {(t, c) for t, c, ok in replays if ok}
    assert stats.sft_examples == len(stats.kept) > 0
    assert all((k["task_id"], tuple(k["commands"])) in passing for k in stats.kept)  # only verified rewrites
    assert stats.mean_turns_after < stats.mean_turns_before  # the minimiser dropped the needless `ls`
    assert stats.sft_loss_last < stats.sft_loss_first
    after = _success(world, seed=1)
    assert after > before + 0.2, (before, after)
    # the critic: untouched in memory and on disk
    assert fingerprint(critic) == before_hash
    assert fingerprint(load_critic(tmp_path / "critic")) == before_hash
    assert all(p.read_bytes() == b for p, b in files.items())


@pytest.mark.slow
def test_rsr_trains_on_nothing_when_no_rewrite_reverifies(tmp_path):
    """Every sampled success is rejected at re-verification (a replay that always fails): the
    stage must train on nothing, so the actor stays bit-identical. Runs the LLM planner (the
    actor itself) and the cleaned-transcript fallback, both rejected."""
    from minirsi.core.critic import fingerprint
    from minirsi.core.rsr import run_rsr
    from minirsi.engine.sampler import HFSampler

    world = toy_world(tmp_path / "tasks")
    h0 = fingerprint(world.actor)
    reject = FakeReplay(["a command no run contains"])
    cfg = RSRConfig(samples_per_task=8, planner="llm", planner_max_new_tokens=40, lr=3e-3, epochs=2,
                    batch_size=4, seed=0)
    stats = run_rsr(world.actor, world.tok, world.tasks, cfg, world.rollout_fn, replay_fn=reject, sampler_factory=HFSampler)
    assert stats.runs_verified > 0 and reject.calls > 0
    assert stats.reverified == stats.sft_examples == 0
    assert fingerprint(world.actor) == h0
