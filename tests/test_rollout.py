"""The rollout engine: token bookkeeping, stop rules, failures, streaming, ATIF, the OpenAI path.

Sandboxes and the verifier are small fakes (the engine takes them as arguments), so these tests
check the engine alone; the sampler is either the tiny random model (exact ids and log-probs) or
a scripted sampler that replays fixed replies (stop rules and parsing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from minirsi.config import ConfigError, load_config
from minirsi.core import actions
from minirsi.core.episode import collate, read_jsonl, right_pad
from minirsi.engine.models import IM_END, build_tiny_actor, build_tokenizer, token_logprobs
from minirsi.engine.rollout import RolloutConfig, RolloutStats, collect, episode_to_atif, export_atif
from minirsi.engine.sampler import HFSampler, OpenAISampler, Sample
from minirsi.engine.serve import CompletionServer, start_in_thread

logger = logging.getLogger(__name__)

CORPUS = ["```bash\nls -la /app\n```\n", "```bash\necho hello > out.txt\n```\nTASK_COMPLETE\n"] * 20
LOGPROB_TOL = 1e-4  # float32 CPU: incremental KV-cache decode vs one forward pass, see test_sampler


# ---------------------------------------------------------------- fakes


@dataclass(frozen=True)
class FakeTask:
    task_id: str
    instruction: str
    family: str = "toy"
    difficulty: str = "easy"
    agent_timeout_sec: float = 600.0


@dataclass
class Result:
    output: str
    exit_code: int | None = 0
    timed_out: bool = False
    truncated: bool = False


@dataclass
class FakeSandbox:
    """Echoes each command; dies (raises) on command number ``die_at`` (1-based)."""

    task: FakeTask
    die_at: int | None = None
    sleep: float = 0.0
    commands: list[str] = field(default_factory=list)
    closed: bool = False

    def run(self, command: str, timeout: float) -> Result:
        if self.closed:
            raise RuntimeError("run() on a closed sandbox")
        self.commands.append(command)
        if self.die_at is not None and len(self.commands) >= self.die_at:
            raise RuntimeError("sandbox died: the shell exited")
        time.sleep(self.sleep)
        return Result(output=f"ran: {command}")

    def close(self) -> None:
        self.closed = True


@dataclass
class Verdict:
    success: bool
    passed: int
    total: int
    checks: dict
    output_tail: str = ""
    error: str | None = None


def fake_verify(sandbox: FakeSandbox, task: FakeTask) -> Verdict:
    """Two checks: some command ran; a command said 'solve'."""
    checks = {"ran": "passed" if sandbox.commands else "failed",
              "solved": "passed" if any("solve" in c for c in sandbox.commands) else "failed"}
    passed = sum(v == "passed" for v in checks.values())
    return Verdict(passed == 2, passed, 2, checks)


class Sandboxes:
    """open_sandbox for collect(): remembers every sandbox; some tasks get dying ones."""

    def __init__(self, die_at: dict[str, int] | None = None, fail_open: set[str] = frozenset(), sleep: float = 0.0):
        self.die_at, self.fail_open, self.sleep = die_at or {}, fail_open, sleep
        self.opened: list[FakeSandbox] = []
        self.lock = threading.Lock()

    def __call__(self, task: FakeTask, backend: str) -> FakeSandbox:
        if task.task_id in self.fail_open:
            raise RuntimeError("bwrap: cannot create namespace")
        sb = FakeSandbox(task, self.die_at.get(task.task_id), self.sleep)
        with self.lock:
            self.opened.append(sb)
        return sb


class ScriptedSampler:
    """Replays fixed replies: task ``t`` (found in the prompt text) says ``script[t][k]`` at turn
    k. A reply starting with "CUT:" comes back without <|im_end|> and finish_reason "length"."""

    def __init__(self, tok, scripts: dict[str, list[str]], fail_after_steps: int | None = None):
        self.tok, self.scripts, self.fail_after = tok, scripts, fail_after_steps
        self.steps = 0

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seed=None):
        if self.fail_after is not None and self.steps >= self.fail_after:
            raise KeyboardInterrupt  # what Ctrl-C during a long collection looks like
        self.steps += 1
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            task = next(t for t in self.scripts if f"do {t}." in text)
            k = text.count("<|im_start|>assistant") - 1
            reply = self.scripts[task][min(k, len(self.scripts[task]) - 1)]
            if reply.startswith("CUT:"):
                ids = self.tok.encode(reply[4:], add_special_tokens=False)[:max_new_tokens]
                out.append(Sample(ids, [-0.5] * len(ids), "length"))
            else:
                ids = self.tok.encode(reply, add_special_tokens=False) + [self.tok.convert_tokens_to_ids(IM_END)]
                out.append(Sample(ids, [-0.25] * len(ids), "stop"))
        return out


class RecordingSampler:
    """Wraps a sampler and records every (prompt, sample) it produced."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, prompts, *args, **kwargs):
        samples = self.inner.generate(prompts, *args, **kwargs)
        self.calls.append(len(prompts))
        self.record = getattr(self, "record", []) + [(list(p), s) for p, s in zip(prompts, samples)]
        return samples


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_actor(tok, seed=0).eval()


def tasks(n: int) -> list[FakeTask]:
    return [FakeTask(f"t{i}", f"Please do t{i}.") for i in range(n)]


def cfg(**kw) -> RolloutConfig:
    base = dict(max_turns=3, max_new_tokens=24, max_context_tokens=1024, concurrency=4, temperature=1.0, seed=0)
    return RolloutConfig(**{**base, **kw})


def check_invariants(ep) -> None:
    n = len(ep.token_ids)
    assert len(ep.action_mask) == len(ep.turn_ids) == len(ep.logprobs) == n
    assert all(a <= b for a, b in zip(ep.turn_ids, ep.turn_ids[1:])), "turn_ids decrease"
    assert ep.action_mask[-1] == 1, "the sequence must end on an action token"
    assert all((lp is None) == (m == 0) for lp, m in zip(ep.logprobs, ep.action_mask))
    assert ep.action_mask[: ep.prompt_len] == [0] * ep.prompt_len
    assert ep.turns == len({t for t, m in zip(ep.turn_ids, ep.action_mask) if m}) == len(ep.transcript)


# ---------------------------------------------------------------- tests


def test_right_pad_is_the_one_padding_of_a_batch():
    ids, att, mask = right_pad([[5, 6, 7], [8], [9, 10]], pad_id=0, masks=[[0, 1, 1], [1], [1, 0]])
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]] and ids.dtype == torch.long
    assert att.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]] and att.dtype == torch.long
    assert mask.tolist() == [[0, 1, 1], [1, 0, 0], [1, 0, 0]] and mask.dtype == torch.float32
    assert right_pad([[1, 2]], pad_id=3)[2] is None
    with pytest.raises(ValueError, match="at least one row"):
        right_pad([], pad_id=0)


def test_action_tokens_are_the_sampled_ids_and_logprobs_match_training(model, tok):
    rec = RecordingSampler(HFSampler(model, tok))
    sbs = Sandboxes()
    eps = collect(tasks(6), rec, tok, cfg(), progress=False, open_sandbox=sbs, verify=fake_verify)
    assert [e.task_id for e in eps] == [f"t{i}" for i in range(6)]
    assert rec.calls[0] == 4, "the first step must batch `concurrency` episodes in one call"
    assert rec.inner.cache_hits > 0, "later turns should continue from kept KV prefixes"
    by_prompt = {tuple(p): s for p, s in rec.record}
    for ep in eps:
        check_invariants(ep)
        pos = 0
        for k in range(ep.turns):  # action k: the positions with mask 1 and turn id k
            span = [t for t, (m, tid) in enumerate(zip(ep.action_mask, ep.turn_ids)) if m and tid == k]
            assert span == list(range(span[0], span[-1] + 1)), "an action must be contiguous"
            sample = by_prompt[tuple(ep.token_ids[: span[0]])]  # what the sampler saw -> what it drew
            assert ep.token_ids[span[0] : span[-1] + 1] == sample.token_ids
            assert [ep.logprobs[t] for t in span] == sample.logprobs
            if sample.finish_reason == "length" and k < ep.turns - 1:  # cut reply: harness closes it
                assert ep.token_ids[span[-1] + 1] == tok.convert_tokens_to_ids(IM_END)
            pos = span[-1]
        assert pos == len(ep.token_ids) - 1
    assert all(sb.closed for sb in sbs.opened)

    batch = collate(eps, pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature=1.0)  # (B, T)
    m = batch["action_mask"].bool()
    gap = (lp[m] - batch["old_logprobs"][m]).abs()
    logger.info("rollout log-prob gap (sampler vs training forward): mean %.3e, max %.3e over %d tokens",
                gap.mean(), gap.max(), int(m.sum()))
    assert gap.max().item() < LOGPROB_TOL


def test_seeded_rollouts_are_reproducible(model, tok):
    def run(seed):
        eps = collect(tasks(5), HFSampler(model, tok), tok, cfg(seed=seed), progress=False,
                      open_sandbox=Sandboxes(), verify=fake_verify)
        return [(e.token_ids, e.logprobs) for e in eps]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_scripted_episode_stop_rules_and_observations(tok):
    scripts = {
        "t0": ["```bash\nsolve it\n```", "TASK_COMPLETE"],  # done after 2 turns, success
        "t1": ["I think I should look around.", "```bash\nls\n```", "```bash\nls\n```"],  # max_turns
        "t2": ["```bash\nsolve\n```\nTASK_COMPLETE"],  # runs and completes in one reply
        "t3": ["CUT:```bash\necho never closed"] * 3,  # cut replies: no command, reminders
    }
    sbs = Sandboxes()
    eps = collect(tasks(4), ScriptedSampler(tok, scripts), tok, cfg(), progress=False,
                  open_sandbox=sbs, verify=fake_verify)
    e0, e1, e2, e3 = eps
    for ep in eps:
        check_invariants(ep)
    assert (e0.stop_reason, e0.turns, e0.success, e0.passed, e0.total) == ("done", 2, True, 2, 2)
    assert (e1.stop_reason, e1.turns, e1.parse_errors, e1.success, e1.passed) == ("max_turns", 3, 1, False, 1)
    assert (e2.stop_reason, e2.turns, e2.success) == ("done", 1, True)
    assert (e3.stop_reason, e3.parse_errors, e3.passed) == ("max_turns", 3, 0)
    # The reminder answers the free-text reply, as observation tokens of turn 1.
    reminder = actions.render_observation_ids(tok, actions.FORMAT_REMINDER)
    obs1 = [t for t, m, k in zip(e1.token_ids, e1.action_mask, e1.turn_ids) if not m and k == 1]
    assert obs1 == reminder and e1.transcript[0]["observation"] == actions.FORMAT_REMINDER
    # t0's observation is the formatted command output; its final action's answer is not stored.
    obs = actions.format_observation([Result("ran: solve it")])
    assert e0.transcript[0]["observation"] == obs and e0.transcript[0]["shown"]
    assert e0.token_ids[-1] == tok.convert_tokens_to_ids(IM_END) and e0.turn_ids[-1] == 1
    # A cut reply (finish "length") is closed by the harness: <|im_end|> opens the observation.
    obs3 = [t for t, m, k in zip(e3.token_ids, e3.action_mask, e3.turn_ids) if not m and k == 1]
    assert obs3 == [tok.convert_tokens_to_ids(IM_END)] + reminder
    assert e3.token_ids[-1] != tok.convert_tokens_to_ids(IM_END)


def test_dead_sandbox_fails_its_episode_and_the_others_finish(tok):
    scripts = {f"t{i}": ["```bash\nstep\n```", "```bash\nsolve\n```", "TASK_COMPLETE"] for i in range(5)}
    sbs = Sandboxes(die_at={"t1": 2}, fail_open={"t3"})
    eps = collect(tasks(5), ScriptedSampler(tok, scripts), tok, cfg(concurrency=5), progress=False,
                  open_sandbox=sbs, verify=fake_verify)
    dead, unopened = eps[1], eps[3]
    assert (dead.stop_reason, dead.success, dead.passed, dead.turns) == ("sandbox_error", False, 0, 2)
    assert "died" in dead.error
    check_invariants(dead)
    assert (unopened.stop_reason, unopened.success, unopened.turns) == ("sandbox_error", False, 0)
    assert "did not open" in unopened.error and unopened.meta["no_action"]
    for ep in (eps[0], eps[2], eps[4]):
        assert (ep.stop_reason, ep.success, ep.error) == ("done", True, None)
    assert all(sb.closed for sb in sbs.opened)


def test_context_and_time_limits(tok):
    scripts = {"t0": ["```bash\nls\n```"] * 10}
    limit = len(actions.render_prompt_ids(tok, "Please do t0.")) + 24 + 60  # room for ~2 turns
    eps = collect(tasks(1), ScriptedSampler(tok, scripts), tok, cfg(max_turns=10, max_context_tokens=limit),
                  progress=False, open_sandbox=Sandboxes(), verify=fake_verify)
    assert eps[0].stop_reason == "context" and len(eps[0].token_ids) <= limit - 24 and eps[0].turns >= 2
    check_invariants(eps[0])
    slow = Sandboxes(sleep=0.3)
    eps = collect(tasks(1), ScriptedSampler(tok, scripts), tok, cfg(max_turns=10, episode_timeout=0.5),
                  progress=False, open_sandbox=slow, verify=fake_verify)
    assert eps[0].stop_reason == "timeout" and 1 <= eps[0].turns < 10
    check_invariants(eps[0])


class _SlowSampler(ScriptedSampler):
    """Generation that takes ``delay`` seconds a call: what a big batch or a loaded machine does."""

    def __init__(self, tok, scripts, delay: float):
        super().__init__(tok, scripts)
        self.delay = delay

    def generate(self, *args, **kwargs):
        time.sleep(self.delay)
        return super().generate(*args, **kwargs)


class _TimingOut(Sandboxes):
    """Sandboxes whose every command comes back at once as timed out (as if killed at its budget)."""

    def __call__(self, task, backend):
        sb = super().__call__(task, backend)
        sb.run = lambda command, timeout: Result(output="", exit_code=None, timed_out=True)
        return sb


def test_the_time_limit_counts_the_episodes_own_command_time_not_the_wait_for_generation(tok):
    scripts = {"t0": ["```bash\nls\n```"] * 10}
    # 6 generation calls of >= 0.2 s each: over the 0.5 s limit in wall time, ~0 s of command time.
    eps = collect(tasks(1), _SlowSampler(tok, scripts, delay=0.2), tok, cfg(max_turns=6, episode_timeout=0.5),
                  progress=False, open_sandbox=Sandboxes(), verify=fake_verify)
    assert (eps[0].stop_reason, eps[0].turns) == ("max_turns", 6) and eps[0].meta["wall_s"] > 1.0
    assert eps[0].meta["command_s"] < 0.5
    # A timed-out command is charged its whole budget however quickly it was killed: 10 + 10 + 5 = 25.
    eps = collect(tasks(1), ScriptedSampler(tok, scripts), tok, cfg(max_turns=10, command_timeout=10.0,
                  episode_timeout=25.0), progress=False, open_sandbox=_TimingOut(), verify=fake_verify)
    assert (eps[0].stop_reason, eps[0].turns, eps[0].meta["command_s"]) == ("timeout", 3, 25.0)


def test_jsonl_streams_episodes_and_survives_interruption(tok, tmp_path):
    # t0 finishes at step 1, t1 at step 2; the sampler is interrupted at step 3 while t2 is live.
    scripts = {"t0": ["TASK_COMPLETE"], "t1": ["```bash\nls\n```", "TASK_COMPLETE"], "t2": ["```bash\nls\n```"]}
    out = tmp_path / "eps.jsonl"
    with pytest.raises(KeyboardInterrupt):
        collect(tasks(3), ScriptedSampler(tok, scripts, fail_after_steps=2), tok, cfg(max_turns=8), out_path=out,
                progress=False, open_sandbox=Sandboxes(), verify=fake_verify)
    kept = list(read_jsonl(out))
    assert sorted(e.task_id for e in kept) == ["t0", "t1"]
    first = json.loads(out.read_text().splitlines()[0])
    for key in ("task", "token_ids", "logprobs", "action_mask", "turn_ids", "success", "passed", "total", "turns"):
        assert key in first
    with out.open("a") as f:  # a process killed mid-write leaves a torn last line
        f.write(out.read_text().splitlines()[0][:50])
    assert [e.task_id for e in read_jsonl(out)] == [e.task_id for e in kept]


def test_a_resumed_collection_runs_only_the_episodes_it_had_not_finished(tok, tmp_path):
    from minirsi.engine.rollout import finished_in

    # As above: t0 and t1 finish, the collection is interrupted while t2 is live, t3 never started.
    scripts = {"t0": ["TASK_COMPLETE"], "t1": ["```bash\nls\n```", "TASK_COMPLETE"], "t2": ["```bash\nls\n```"],
               "t3": ["```bash\nsolve\n```", "TASK_COMPLETE"]}
    out, todo = tmp_path / "eps.jsonl", tasks(4)
    with pytest.raises(KeyboardInterrupt):
        collect(todo, ScriptedSampler(tok, scripts, fail_after_steps=2), tok, cfg(max_turns=8, concurrency=3),
                out_path=out, progress=False, open_sandbox=Sandboxes(), verify=fake_verify)
    before = out.read_text()
    with out.open("a") as f:  # and it was killed writing a line
        f.write(before.splitlines()[0][:50])
    finished = finished_in(out, todo)
    assert sorted(finished) == [0, 1] and out.read_text() == before  # the torn line is cut off
    again = Sandboxes()
    eps = collect(todo, ScriptedSampler(tok, scripts), tok, cfg(max_turns=8, concurrency=3), out_path=out,
                  progress=False, open_sandbox=again, verify=fake_verify, finished=finished)
    assert sorted(sb.task.task_id for sb in again.opened) == ["t2", "t3"]  # only what had not finished
    assert [e.task_id for e in eps] == ["t0", "t1", "t2", "t3"] and eps[0] is finished[0]
    lines = out.read_text().splitlines()
    assert out.read_text().startswith(before)  # the finished episodes' lines untouched, the new ones after them
    assert sorted(json.loads(x)["meta"]["index"] for x in lines) == [0, 1, 2, 3]  # each episode once
    assert finished_in(out, todo).keys() == {0, 1, 2, 3}
    with pytest.raises(ValueError, match=f"{out}.*another collection.*delete"):  # a journal of other tasks
        finished_in(out, tasks(2)[::-1])


def test_atif_export_carries_the_exact_action_ids(tok, tmp_path):
    scripts = {"t0": ["```bash\nsolve\n```", "TASK_COMPLETE"]}
    eps = collect(tasks(1), ScriptedSampler(tok, scripts), tok, cfg(), progress=False,
                  open_sandbox=Sandboxes(), verify=fake_verify)
    paths = export_atif(eps, tmp_path / "atif", instructions={"t0": "Please do t0."})
    traj = json.loads(paths[0].read_text())
    assert traj["schema_version"].startswith("ATIF-v1")
    agent = [s for s in traj["steps"] if s["source"] == "agent"]
    assert [s["step_id"] for s in traj["steps"]] == list(range(1, len(traj["steps"]) + 1))
    assert len(agent) == 2 and agent[0]["tool_calls"][0]["arguments"] == {"command": "solve"}
    ids = [t for s in agent for t in s["metrics"]["completion_token_ids"]]
    assert ids == [t for t, m in zip(eps[0].token_ids, eps[0].action_mask) if m]
    assert episode_to_atif(eps[0])["final_metrics"]["extra"]["success"] is True


def test_openai_backend_gives_the_same_episodes_as_hf(model, tok):
    hf = HFSampler(model, tok)
    srv = CompletionServer(hf, tok, "tiny", "127.0.0.1", 0)
    start_in_thread(srv)
    try:
        c = cfg(temperature=0.0, max_turns=2)
        local = collect(tasks(3), hf, tok, c, progress=False, open_sandbox=Sandboxes(), verify=fake_verify)
        remote = collect(tasks(3), OpenAISampler(srv.url, "tiny", max_retries=0), tok, c, progress=False,
                         open_sandbox=Sandboxes(), verify=fake_verify)
    finally:
        srv.shutdown()
        srv.server_close()
    assert [e.token_ids for e in remote] == [e.token_ids for e in local]
    for r, l in zip(remote, local):
        assert [x or 0.0 for x in r.logprobs] == pytest.approx([x or 0.0 for x in l.logprobs], abs=1e-6)


def test_config_validation_and_loading(tmp_path):
    with pytest.raises(ValueError, match="max_turns"):
        RolloutConfig(max_turns=0)
    with pytest.raises(ValueError, match="backend"):
        RolloutConfig(backend="podman")
    with pytest.raises(ValueError, match="max_context_tokens"):
        RolloutConfig(max_new_tokens=512, max_context_tokens=256)
    (tmp_path / "r.yaml").write_text("max_turns: 4\nseed: null\n")
    c = load_config(RolloutConfig, tmp_path / "r.yaml", ["temperature=0.5"])
    assert (c.max_turns, c.seed, c.temperature) == (4, None, 0.5)
    with pytest.raises(ConfigError, match="max_turn"):
        load_config(RolloutConfig, None, ["max_turn=3"])


def test_prompt_that_cannot_fit_is_a_value_error(tok):
    with pytest.raises(ValueError, match="max_context_tokens"):
        collect([FakeTask("big", "x " * 400)], ScriptedSampler(tok, {}), tok, cfg(max_context_tokens=100),
                progress=False, open_sandbox=Sandboxes(), verify=fake_verify)


def test_stats_measure_generation_time(tok):
    stats = RolloutStats()
    scripts = {"t0": ["```bash\nls\n```"] * 3}
    collect(tasks(1), ScriptedSampler(tok, scripts), tok, cfg(), progress=False, stats=stats,
            open_sandbox=Sandboxes(sleep=0.05), verify=fake_verify)
    assert stats.steps == 3 and stats.wall_s > stats.generate_s > 0
    assert 0 < stats.generate_cpu_s <= stats.generate_s + 0.01  # thread CPU never exceeds its wall (clock grain)
    assert 0 < stats.outside_generation < 1


class _ThreadsSeen(ScriptedSampler):
    """Records torch's intra-op thread count at every generation call."""

    def generate(self, *args, **kwargs):
        self.seen = getattr(self, "seen", []) + [torch.get_num_threads()]
        return super().generate(*args, **kwargs)


def test_a_rollout_samples_on_its_own_thread_count_and_gives_the_callers_back(tok):
    # The presets train on 2 threads and sample on 1 (rollout.threads): the caller's count must
    # come back after the collection, also when it is interrupted.
    scripts = {"t0": ["```bash\nls\n```", "TASK_COMPLETE"], "t1": ["TASK_COMPLETE"]}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        sampler = _ThreadsSeen(tok, scripts)
        collect(tasks(2), sampler, tok, cfg(threads=1), progress=False, open_sandbox=Sandboxes(), verify=fake_verify)
        assert sampler.seen == [1, 1] and torch.get_num_threads() == 2
        sampler = _ThreadsSeen(tok, scripts)
        collect(tasks(2), sampler, tok, cfg(), progress=False, open_sandbox=Sandboxes(), verify=fake_verify)
        assert sampler.seen == [2, 2] and torch.get_num_threads() == 2  # threads=0: the caller's
        with pytest.raises(KeyboardInterrupt):
            collect(tasks(2), _ThreadsSeen(tok, scripts, fail_after_steps=1), tok, cfg(threads=1), progress=False,
                    open_sandbox=Sandboxes(), verify=fake_verify)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="rollout.threads=-1"):
        RolloutConfig(threads=-1)


# ---------------------------------------------------------------- real sandboxes, the CLI


def _sandbox_ready() -> bool:
    if shutil.which("bwrap") is None:
        return False
    from minirsi.env.sandbox.bwrap import default_rootfs

    return (Path(default_rootfs()) / "usr/bin/python3").exists()


needs_sandbox = pytest.mark.skipif(not _sandbox_ready(), reason="bwrap or the sandbox rootfs is missing (scripts/setup.sh)")


def _oracle_commands(task) -> str:
    """The task's reference solution as one block (its shebang, comments and set -e left out:
    set -e would end the persistent shell at the first failing line)."""
    lines = task.solution_script.read_text().splitlines()
    return "\n".join(l for l in lines if l.strip() and not l.startswith("#") and l.strip() != "set -e")


@needs_sandbox
def test_real_sandboxes_and_verifier_score_oracle_and_idle_agents(tok, tmp_path):
    """bwrap + the real verifier: replaying the oracle succeeds, doing nothing fails."""
    from minirsi.env.tasks import load_tasks
    from toy_envs import generate_suite

    generate_suite("train", tmp_path / "tasks", n=4, seed=0)
    pool, errors = load_tasks(tmp_path / "tasks")
    assert not errors and len(pool) == 4
    scripts = {}
    for i, t in enumerate(pool):
        reply = f"```bash\n{_oracle_commands(t)}\n```" if i % 2 == 0 else "```bash\nls\n```"
        scripts[t.task_id] = [reply, "TASK_COMPLETE"]
    # The scripted sampler finds a task's script by "do <task_id>." in the prompt.
    real = [dataclasses.replace(t, instruction=f"Please do {t.task_id}.") for t in pool]
    eps = collect(real, ScriptedSampler(tok, scripts), tok, cfg(command_timeout=20.0), progress=False)
    for i, ep in enumerate(eps):
        check_invariants(ep)
        assert ep.error is None and ep.stop_reason == "done" and ep.total >= 1
        assert ep.success == (i % 2 == 0), (ep.task_id, ep.transcript, ep.meta)
        if i % 2 == 0:
            assert ep.passed == ep.total


@pytest.mark.slow
@needs_sandbox
def test_rollout_cli_writes_jsonl_and_atif(tok, model, tmp_path):
    from minirsi.engine.models import save_actor
    from toy_envs import generate_suite

    save_actor(model, tok, tmp_path / "model")
    generate_suite("train", tmp_path / "tasks", n=2, seed=0)
    out, atif = tmp_path / "eps.jsonl", tmp_path / "atif"
    cmd = [sys.executable, "-m", "minirsi.cli", "rollout", "--model", str(tmp_path / "model"), "--tasks",
           str(tmp_path / "tasks"), "--episodes", "3", "--out", str(out), "--atif", str(atif), "--no-progress",
           "max_turns=2", "max_new_tokens=16", "concurrency=3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see one_torch_thread
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(lines) == 3 and len(list(atif.glob("*.json"))) == 3
    for d in lines:
        assert {"task", "token_ids", "logprobs", "action_mask", "turn_ids", "success", "passed", "total", "turns"} <= set(d)
        assert len(d["token_ids"]) == len(d["logprobs"]) == len(d["action_mask"]) == len(d["turn_ids"])
    assert "3 episodes" in proc.stdout
