"""The rollout engine: many multi-turn episodes at once, with exact token bookkeeping.

docs/method.md section 3. An episode is the prompt followed by turns; turn k is an action a_k the
policy sampled and the observation o_{k+1} the sandbox returned. The training sequence is
built by appending ids, never by re-tokenising text:

    token_ids   = prompt ++ a_0 ++ o_1 ++ a_1 ++ o_2 ++ ... ++ a_{K-1}
    action_mask =   0...0 ++ 1..1 ++ 0..0 ++ 1..1 ++ ...      ++ 1..1
    turn_ids    =   0...0 ++ 0..0 ++ 1..1 ++ 1..1 ++ 2..2 ... ++ K-1
    logprobs    = None... ++ log pi_tau(a_0 | .) ++ None ... (the sampler's, see engine/sampler)

* a_k are exactly the ids the sampler returned (its stop id ``<|im_end|>`` included);
* o_{k+1} = ``actions.render_observation_ids(format_observation(results))`` (ChatML user turn
  plus the next assistant header); when a_k was cut by ``max_new_tokens`` (no ``<|im_end|>``),
  the harness closes the turn by putting ``<|im_end|>`` first in o_{k+1}, as an observation
  token (mask 0), so the context stays well-formed ChatML;
* the observation answering the last action is not stored, so every sequence ends on an action
  token, where the reward is placed (``episode.collate``).

The loop, one step at a time::

    admit episodes up to ``concurrency`` (their sandboxes open in a thread pool)
    while any episode is live:
        samples = sampler.generate([context of every live episode])   # ONE batched call
        (new episodes' sandboxes finished opening meanwhile: wait for them)
        parse each reply; run the commands of all episodes concurrently (thread pool)
        append observations; episodes that completed / hit a limit go to the verifier
        (verifiers run in a second pool while generation goes on); admit new episodes

``collect`` is this loop; its steps are the methods of ``_Collection``.

An episode stops when the reply says ``TASK_COMPLETE`` ("done"), after ``max_turns`` actions
("max_turns"), when the next turn would not fit in ``max_context_tokens`` ("context"), or when
its commands have used ``episode_timeout`` / the task's ``agent_timeout_sec`` ("timeout"). A
reply with no command and no completion is answered with ``actions.FORMAT_REMINDER`` and counts
in ``parse_errors``. A sandbox that fails to open, raises (``SandboxError``) or dies ends only
its own episode, recorded as a failure: ``stop_reason="sandbox_error"``, ``error`` set,
``success=False``, ``passed=0``, ``total=0`` (the verifier never ran, so C is unknown).

Episodes are appended to a JSONL file as they finish (``episode.JsonlWriter``), so an
interrupted collection keeps every episode it finished, and a later call given those episodes
(``finished``) runs only the others (``make_rollout_fn``'s journal resumes an RPR step so);
``export_atif`` writes them as ATIF trajectories (Harbor's Agent Trajectory Interchange Format)
for viewing.

Departures from the paper: a step waits for the slowest episode's commands before the next
batched generation (a simple, deterministic schedule; per-command timeouts bound the wait),
where an asynchronous engine would refill the batch continuously.

What counts against an episode's time limit (our choice; Harbor counts the agent's wall time):
the time its own commands ran in its sandbox, a timed-out command counting as the whole budget
it was given. Not the batched generation, nor the wait for other episodes' commands: those grow
with the batch and with the machine's load (an evaluation episode of the smoke preset spent
~20-40 s of wall time waiting on a loaded 2-core machine, against limits of 60-180 s), so a
wall-clock limit made the same seed stop different episodes on a busier machine. What stays
load-dependent is only a command whose own run time is near its ``command_timeout`` (or near
what is left of the episode's budget), and the verifier's and the sandbox start's timeouts
(30 s each, against tens of milliseconds for the toy tasks).

Run::

    minirsi rollout --model runs/toy/base --tasks tasks/train --episodes 64 --out eps.jsonl
    minirsi rollout --model runs/toy/base --server http://127.0.0.1:8000 --tasks ... --out ...
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn
from tqdm import tqdm
from transformers import AutoTokenizer

from minirsi.config import load_config
from minirsi.core import actions
from minirsi.core.episode import Episode, JsonlWriter, read_jsonl, write_jsonl
from minirsi.core.rpr import RolloutFn
from minirsi.core.rsr import Replay, ReplayFn
from minirsi.engine.models import load_actor, torch_threads
from minirsi.engine.sampler import FINISH_LENGTH, HFSampler, OpenAISampler, Sample, Sampler
from minirsi.env import sandbox, verifier
from minirsi.env.sandbox import BACKENDS, open_sandbox
from minirsi.env.tasks import load_tasks
from minirsi.env.verifier import verify

logger = logging.getLogger(__name__)



@dataclass
class RolloutConfig:
    """How episodes are run. Loadable with ``minirsi.config.load_config(RolloutConfig, ...)``."""

    max_turns: int = 8
    """Most actions per episode (K_max); the episode stops with stop_reason "max_turns"."""
    max_new_tokens: int = 256
    """Most tokens sampled per action; a longer reply is cut (its turn is closed by the harness)."""
    temperature: float = 1.0
    """Sampling temperature tau (0 = greedy); the trainer must score with the same tau."""
    max_context_tokens: int = 4096
    """Longest training sequence: an episode stops ("context") when its context plus the next
    observation plus ``max_new_tokens`` would exceed it."""
    command_timeout: float = 30.0
    """Seconds one command block may run in the sandbox before it is killed ([timed out])."""
    episode_timeout: float = 600.0
    """Seconds of command time per episode (capped by the task's agent_timeout_sec); then
    "timeout". Only the episode's own commands count, not generation or waits (module docstring)."""
    obs_max_chars: int = actions.OBS_MAX_CHARS
    """Characters of each block's output shown to the agent (head and tail kept)."""
    concurrency: int = 16
    """Episodes live at once: the generation batch size and the sandbox thread-pool size."""
    backend: str = "bwrap"
    """Sandbox backend: bwrap (rootless, this machine) or docker."""
    seed: int | None = 0
    """Seed of the sampler's random draws (step s uses a seed derived from (seed, s)); None for
    fresh randomness each run."""
    threads: int = 0
    """torch intra-op threads while collecting (0: leave the caller's setting). On a small CPU
    the sandboxes and verifiers need a core of their own during a rollout, and nothing else runs
    during a training step, so toy-cpu samples on 1 thread and trains on 2 (``RunConfig.threads``)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_context_tokens", "concurrency", "obs_max_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)}: must be a positive integer")
        if self.threads < 0:
            raise ValueError(f"rollout.threads={self.threads}: use 0 (the caller's setting) or a positive count")
        for name in ("command_timeout", "episode_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.{name}={getattr(self, name)}: must be > 0 seconds")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if self.backend not in BACKENDS:
            raise ValueError(f"rollout.backend={self.backend!r}: use one of {BACKENDS}")
        if self.obs_max_chars < 20:
            raise ValueError(f"rollout.obs_max_chars={self.obs_max_chars}: too small to show output; use >= 20")
        if self.max_new_tokens >= self.max_context_tokens:
            raise ValueError(
                f"rollout.max_new_tokens={self.max_new_tokens} leaves no room for the prompt in "
                f"max_context_tokens={self.max_context_tokens}; raise max_context_tokens"
            )


@dataclass
class RolloutStats:
    """Where a ``collect`` call spent its time (filled in when passed to ``collect``)."""

    wall_s: float = 0.0
    generate_s: float = 0.0
    """Seconds inside ``sampler.generate``."""
    generate_cpu_s: float = 0.0
    """CPU seconds of the collecting thread inside ``sampler.generate`` (``time.thread_time``).
    Below ``generate_s`` by the time that thread was ready to run but waited: for the GIL, which
    the sandbox and verifier threads hold between their system calls (an in-process sampler
    releases and retakes it at every torch op), or for a core."""
    open_s: float = 0.0
    """Seconds waiting for new episodes' sandboxes to open (after their first generation,
    which the opening overlaps)."""
    commands_s: float = 0.0
    """Seconds waiting for the step's commands (all episodes' run concurrently)."""
    drain_s: float = 0.0
    """Seconds waiting at the end for the last verifiers (earlier ones overlap generation)."""
    steps: int = 0
    """Batched generation calls."""
    generated_tokens: int = 0

    @property
    def outside_generation(self) -> float:
        """Share of wall time not spent generating (sandbox, verifier, bookkeeping)."""
        return 1.0 - self.generate_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _Run:
    """A live episode: its sandbox and the token lists being built."""

    index: int
    task: Any
    ids: list[int]
    started: float
    """time.monotonic() when the episode was admitted (for its wall_s, which nothing decides on)."""
    limit_s: float
    """The episode's time limit, in seconds of its own command time."""
    used_s: float = 0.0
    """Command time used so far: each command's run time, a timed-out one's whole budget."""
    sandbox: Any = None
    opening: Future | None = None
    """The sandbox being opened in the pool (overlapping the episode's first generation)."""
    logprobs: list[float | None] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    turns: int = 0
    parse_errors: int = 0
    transcript: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | None = None
    error: str | None = None

    def remaining(self) -> float:
        return self.limit_s - self.used_s


def _default_open(task: Any, backend: str) -> Any:
    return open_sandbox(task, backend=backend)


def _default_verify(sandbox: Any, task: Any) -> Any:
    return verify(sandbox, task)


def _step_seed(seed: int | None, step: int) -> int | None:
    # Mix (seed, step) so that runs with seeds s and s+1 do not share step streams.
    return None if seed is None else (seed * 1_000_003 + step) % (2**63)


def collect(
    tasks: Sequence[Any],
    sampler: Sampler,
    tokenizer: Any,
    cfg: RolloutConfig,
    out_path: str | Path | None = None,
    progress: bool = True,
    *,
    stats: RolloutStats | None = None,
    open_sandbox: Callable[[Any, str], Any] = _default_open,
    verify: Callable[[Any, Any], Any] = _default_verify,
    finished: dict[int, Episode] | None = None,
) -> list[Episode]:
    """Run one episode per entry of ``tasks`` (repeat a task to get several) and return them in
    the order of ``tasks``; with ``out_path`` each is also appended to that JSONL file as it
    finishes.

    Args:
        tasks: ``tasks.Task`` objects (task_id, family, difficulty, instruction,
            agent_timeout_sec are read).
        sampler: an ``HFSampler``, ``OpenAISampler`` or anything with the ``Sampler`` protocol.
        tokenizer: the policy's ChatML tokenizer (renders prompts and observations, decodes
            actions for ``actions.parse_action``).
        cfg: a ``RolloutConfig``.
        stats: when given, filled with timing figures (``RolloutStats``).
        open_sandbox, verify: the environment (defaults: ``minirsi.env.sandbox.open_sandbox`` and
            ``minirsi.env.verifier.verify``); tests pass fakes.
        finished: episodes of this call that an interrupted attempt already finished, by
            their index in ``tasks`` (``meta["index"]``): not run again, returned in their
            place, not written to ``out_path`` again.
    Raises:
        ValueError: a task whose prompt plus ``max_new_tokens`` exceeds ``max_context_tokens``,
            or a ``finished`` episode whose index or task does not match ``tasks``.
    """
    finished = _check_finished(tasks, finished)
    stats = stats if stats is not None else RolloutStats()
    t_start = time.monotonic()
    stop_id = actions.special_id(tokenizer, actions.IM_END)
    prompts = _prompt_ids(tasks, tokenizer, cfg)
    c = _Collection(tasks, prompts, sampler, tokenizer, cfg, stop_id, out_path, progress, stats, open_sandbox, verify,
                    finished)
    with torch_threads(cfg.threads):
        try:
            step = 0
            while c.has_work():
                c.admit()  # up to ``concurrency`` live; the new ones' sandboxes start opening
                c.enforce_time_limits()
                c.retire()  # stopped episodes go to the verifiers
                if not c.live:  # every episode has ended (the queue is empty too)
                    c.harvest(block=False)
                    continue
                samples = c.sample(_step_seed(cfg.seed, step))  # ONE batched call, in ``live`` order
                step += 1
                c.await_sandboxes()
                c.act(samples)  # parse, run all episodes' commands, append observations
                c.retire()
                c.harvest(block=False)  # write the episodes verified so far
            c.drain()
        finally:
            c.close()  # also when interrupted: close open sandboxes, verify and write what had ended
            stats.wall_s = time.monotonic() - t_start
    episodes = c.episodes()
    _log_summary(episodes, stats)
    return episodes


class _Collection:
    """One ``collect`` call's state, with the steps of its loop as methods (in the loop's order).

    ``live``: the running episodes, in the order they were admitted, which is the order of the
    batch sent to the sampler; ``queue``: indices into ``tasks`` not yet admitted (ascending);
    ``finishing``: the verifier futures of stopped episodes; ``done``: the finished episodes by
    index (the ``finished`` ones included). Sandbox opens and commands run in the ``work`` pool,
    verifiers in the ``fin`` pool, both ``concurrency`` threads wide.
    """

    def __init__(self, tasks: Sequence[Any], prompts: list[list[int]], sampler: Sampler, tokenizer: Any,
                 cfg: RolloutConfig, stop_id: int, out_path: str | Path | None, progress: bool, stats: RolloutStats,
                 open_sandbox: Callable[[Any, str], Any], verify: Callable[[Any, Any], Any],
                 finished: dict[int, Episode]) -> None:
        self.tasks, self.prompts, self.sampler, self.tokenizer, self.cfg = tasks, prompts, sampler, tokenizer, cfg
        self.stop_id, self.stats, self.open_sandbox, self.verify = stop_id, stats, open_sandbox, verify
        # A sampler's kept KV prefixes (HFSampler) belong to the weights of this collection only.
        self.clear_cache = getattr(sampler, "clear_cache", lambda: None)
        self.clear_cache()
        self.writer = JsonlWriter(out_path) if out_path is not None else None
        self.work = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="rollout-sandbox")
        self.fin = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="rollout-verify")
        self.queue = deque(i for i in range(len(tasks)) if i not in finished)
        self.live: list[_Run] = []
        self.finishing: list[Future] = []
        self.done: dict[int, Episode] = dict(finished)
        self.bar = tqdm(total=len(tasks), initial=len(self.done), desc="rollout", unit="ep", disable=not progress)

    def has_work(self) -> bool:
        return bool(self.queue or self.live)

    def admit(self) -> None:
        """Start queued episodes until ``concurrency`` are live; their sandboxes open in the pool
        while their first action is sampled (``await_sandboxes`` waits for them)."""
        n = min(len(self.queue), self.cfg.concurrency - len(self.live))
        new = [self._start(self.queue.popleft()) for _ in range(n)]
        if new:
            # From a helper thread: the pool starts workers lazily and each Thread.start()
            # blocks its caller until the thread runs, slow on a busy machine (docs/experiments.md).
            opens = [(r.task, r.opening) for r in new]
            threading.Thread(target=self._submit_opens, args=(opens,), name="rollout-open", daemon=True).start()
            self.live += new

    def _start(self, i: int) -> _Run:
        """Episode ``i``'s run: the prompt ids as its context, its sandbox still to open."""
        task, prompt = self.tasks[i], self.prompts[i]
        limit = min(self.cfg.episode_timeout, float(getattr(task, "agent_timeout_sec", None) or math.inf))
        run = _Run(i, task, list(prompt), time.monotonic(), limit, prompt_len=len(prompt))
        run.logprobs = [None] * len(run.ids)
        run.mask = [0] * len(run.ids)
        run.turn_ids = [0] * len(run.ids)
        run.opening = Future()
        return run

    def _submit_opens(self, opens: list[tuple[Any, Future]]) -> None:
        """Open each task's sandbox in the pool, its outcome into the paired future (the helper
        thread of ``admit`` runs this; the pairs are taken before, as ``_opened`` clears
        ``run.opening``)."""
        for task, dst in opens:
            try:
                f = self.work.submit(self.open_sandbox, task, self.cfg.backend)
            except RuntimeError as e:  # the pool was shut down (an interrupted collection)
                dst.set_exception(e)
                continue
            f.add_done_callback(lambda f, dst=dst: _chain(f, dst))

    def enforce_time_limits(self) -> None:
        """Stop ("timeout") the episodes whose commands used their time limit: checked between turns."""
        for run in self.live:
            if run.turns > 0 and run.remaining() <= 0:
                run.stop_reason = "timeout"

    def retire(self) -> None:
        """Move stopped episodes from ``live`` to the verifier pool, which runs while generation goes on."""
        keep = []
        for run in self.live:
            if run.stop_reason is None:
                keep.append(run)
            else:
                self.finishing.append(self.fin.submit(_finish, run, self.verify))
        self.live[:] = keep

    def sample(self, seed: int | None) -> list[Sample]:
        """One batched generation: one action per live episode, in ``live`` order."""
        live, cfg, stats = self.live, self.cfg, self.stats
        t0, c0 = time.monotonic(), time.thread_time()
        samples = self.sampler.generate([r.ids for r in live], cfg.max_new_tokens, cfg.temperature, [self.stop_id],
                                        seed)
        stats.generate_s += time.monotonic() - t0
        stats.generate_cpu_s += time.thread_time() - c0
        stats.steps += 1
        stats.generated_tokens += sum(len(s.token_ids) for s in samples)
        if len(samples) != len(live):
            raise RuntimeError(f"sampler returned {len(samples)} samples for {len(live)} prompts")
        return samples

    def await_sandboxes(self) -> None:
        """Wait for new episodes' sandboxes, which opened while the batch was sampled; an episode
        whose sandbox did not open ends without its first action (never acted)."""
        t0 = time.monotonic()
        for run in self.live:
            _opened(run)
        self.stats.open_s += time.monotonic() - t0

    def act(self, samples: list[Sample]) -> None:
        """Append each live episode's action, run its commands, append the observation (or stop it).

        Parsing stays in this thread (tokenizers are not shared across threads); the commands of
        all episodes run concurrently in the pool, and the step waits for the slowest.
        """
        acting = [(r, s) for r, s in zip(self.live, samples) if r.stop_reason is None]
        plans = [_append_action(r, s, self.tokenizer) for r, s in acting]
        futures = [self.work.submit(_run_commands, r, p.commands, self.cfg.command_timeout)
                   for (r, _), p in zip(acting, plans)]
        t0 = time.monotonic()
        outcomes = [f.result() for f in futures]
        self.stats.commands_s += time.monotonic() - t0
        for (run, sample), plan, results in zip(acting, plans, outcomes):
            _observe(run, plan, sample, results, self.tokenizer, self.cfg)

    def harvest(self, block: bool) -> None:
        """Take the verified episodes into ``done`` and the JSONL file (with ``block``, wait for all)."""
        pending = []
        for f in self.finishing:
            if f.cancelled():
                continue
            if block or f.done():
                ep = f.result()
                self.done[ep.meta["index"]] = ep
                if self.writer is not None:
                    self.writer.write(ep)
                self.bar.update(1)
            else:
                pending.append(f)
        self.finishing = pending
        if self.done:
            success = sum(e.success for e in self.done.values()) / len(self.done)
            self.bar.set_postfix(success=f"{success:.2f}", live=len(self.live))

    def drain(self) -> None:
        """Wait for the last verifiers (earlier ones overlapped generation)."""
        t0 = time.monotonic()
        self.harvest(block=True)
        self.stats.drain_s += time.monotonic() - t0

    def close(self) -> None:
        """Finished or interrupted: close what is still open, keep what was written."""
        for run in self.live:
            _opened(run)
            _close(run)
        self.work.shutdown(wait=False, cancel_futures=True)
        # Episodes that already ended are verified and written even after an interruption (each
        # verifier is bounded by its own timeout); a second Ctrl-C stops this wait too.
        self.fin.shutdown(wait=True)
        self.harvest(block=False)
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        self.clear_cache()

    def episodes(self) -> list[Episode]:
        """The finished episodes in the order of ``tasks`` (all of them, unless interrupted)."""
        return [self.done[i] for i in sorted(self.done)]


def _check_finished(tasks: Sequence[Any], finished: dict[int, Episode] | None) -> dict[int, Episode]:
    """A copy of ``finished``, each episode checked against its task (``collect``'s Raises)."""
    finished = dict(finished or {})
    for i, ep in finished.items():
        if not 0 <= i < len(tasks) or ep.task_id != tasks[i].task_id:
            raise ValueError(f"finished episode {i} ({ep.task_id}) does not match task {i} of this collection "
                             f"({tasks[i].task_id if 0 <= i < len(tasks) else 'out of range'})")
    return finished


def _prompt_ids(tasks: Sequence[Any], tokenizer: Any, cfg: RolloutConfig) -> list[list[int]]:
    """Each task's prompt ids (``actions.render_prompt_ids``); one too long for its first action raises."""
    prompts = [actions.render_prompt_ids(tokenizer, t.instruction) for t in tasks]
    for t, p in zip(tasks, prompts):
        if len(p) + cfg.max_new_tokens > cfg.max_context_tokens:
            raise ValueError(
                f"task {t.task_id}: prompt is {len(p)} tokens; with max_new_tokens={cfg.max_new_tokens} "
                f"it exceeds max_context_tokens={cfg.max_context_tokens}; raise max_context_tokens"
            )
    return prompts


def _log_summary(episodes: list[Episode], stats: RolloutStats) -> None:
    if episodes:
        logger.info(
            "rollout: %d episodes, success %.3f, mean turns %.2f, parse errors %d, %.1fs (%.0f%% outside generation)",
            len(episodes),
            sum(e.success for e in episodes) / len(episodes),
            sum(e.turns for e in episodes) / len(episodes),
            sum(e.parse_errors for e in episodes),
            stats.wall_s,
            100 * stats.outside_generation,
        )


def finished_in(path: str | Path, tasks: Sequence[Any]) -> dict[int, Episode]:
    """The episodes that an interrupted ``collect(tasks, out_path=path)`` finished, by their index
    in ``tasks`` (empty when ``path`` does not exist): pass them as ``collect(...,
    finished=...)`` to run only the others. A torn last line (the writer was killed mid-line) is
    cut from the file, so what ``collect`` appends next starts on a line of its own.

    Raises:
        ValueError: an episode in ``path`` that is not one of ``tasks`` (another collection's
            file), naming the file and the fix.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    text = path.read_text()
    episodes = list(read_jsonl(path))
    out: dict[int, Episode] = {}
    for ep in episodes:
        i = ep.meta.get("index")
        if not isinstance(i, int) or not 0 <= i < len(tasks) or tasks[i].task_id != ep.task_id or i in out:
            raise ValueError(f"{path}: episode {ep.task_id} (index {i}) is not one of the {len(tasks)} episodes of "
                             f"this collection, or is there twice; the file belongs to another collection. Fix: "
                             f"delete {path} to collect them all again")
        out[i] = ep
    if text and not text.endswith("\n"):
        write_jsonl(episodes, path)  # atomically, without the torn line
    return out


def _chain(src: Future, dst: Future) -> None:
    """Copy a finished future's outcome into ``dst``."""
    e = src.exception()
    dst.set_exception(e) if e is not None else dst.set_result(src.result())


def _opened(run: _Run) -> None:
    """Wait for the run's sandbox to open; a failure to open ends only this episode."""
    if run.opening is None:
        return
    f, run.opening = run.opening, None
    try:
        run.sandbox = f.result()
    except Exception as e:  # any failure to start is this episode's failure, not the batch's
        run.stop_reason, run.error = "sandbox_error", f"sandbox did not open: {type(e).__name__}: {e}"


def _append_action(run: _Run, sample: Sample, tokenizer: Any) -> actions.ParsedAction:
    """Append the sampled ids as action ``run.turns`` and parse them."""
    k = run.turns
    run.ids += sample.token_ids
    run.logprobs += sample.logprobs
    run.mask += [1] * len(sample.token_ids)
    run.turn_ids += [k] * len(sample.token_ids)
    run.turns += 1
    text = actions.decode_action(tokenizer, sample.token_ids)
    parsed = actions.parse_action(text)
    run.transcript.append({"action": text, "commands": list(parsed.commands), "finish_reason": sample.finish_reason})
    return parsed


def _run_commands(run: _Run, commands: list[str], command_timeout: float) -> list[Any] | None:
    """Run one reply's blocks in order (worker thread). None when the sandbox failed."""
    results = []
    for cmd in commands:
        budget = min(command_timeout, run.remaining())
        if budget <= 0:
            break  # the episode's time is up; later blocks do not run
        t0 = time.monotonic()
        try:
            result = run.sandbox.run(cmd, timeout=budget)
        except Exception as e:  # SandboxError or a crash inside the backend: this episode fails
            logger.warning("episode %d (%s): sandbox failed: %s: %s", run.index, run.task.task_id, type(e).__name__, e)
            run.error = f"sandbox failed: {type(e).__name__}: {e}"
            return None
        # A timed-out command is charged its budget, not the kill's extra moments (which vary with load).
        run.used_s += budget if result.timed_out else min(budget, time.monotonic() - t0)
        results.append(result)
    return results


def _observe(
    run: _Run, plan: actions.ParsedAction, sample: Sample, results: list[Any] | None, tokenizer: Any, cfg: RolloutConfig
) -> None:
    """Decide whether the episode goes on; if so append the observation ids as turn ``run.turns``."""
    turn = run.transcript[-1]
    if results is None:
        run.stop_reason = "sandbox_error"
        turn["observation"] = None
        return
    if plan.error is not None:
        run.parse_errors += 1
        text = actions.FORMAT_REMINDER
    else:
        text = actions.format_observation(results, cfg.obs_max_chars)
    turn["observation"] = text
    turn["shown"] = False
    if plan.done:
        run.stop_reason = "done"
    elif run.turns >= cfg.max_turns:
        run.stop_reason = "max_turns"
    elif run.remaining() <= 0:
        run.stop_reason = "timeout"
    if run.stop_reason is not None:
        return  # the answer to the last action is not part of the training sequence
    obs_ids = actions.render_observation_ids(tokenizer, text)
    if sample.finish_reason == FINISH_LENGTH:  # the reply was cut: the harness closes its turn
        obs_ids = [actions.special_id(tokenizer, actions.IM_END)] + obs_ids
    if len(run.ids) + len(obs_ids) + cfg.max_new_tokens > cfg.max_context_tokens:
        run.stop_reason = "context"
        return
    run.ids += obs_ids
    run.logprobs += [None] * len(obs_ids)
    run.mask += [0] * len(obs_ids)
    run.turn_ids += [run.turns] * len(obs_ids)
    turn["shown"] = True


def _close(run: _Run) -> None:
    if run.sandbox is None:
        return
    try:
        run.sandbox.close()
    except Exception as e:  # a sandbox that will not close must not hide the episode's result
        logger.warning("episode %d: closing the sandbox failed: %s: %s", run.index, type(e).__name__, e)
    run.sandbox = None


def _finish(run: _Run, verify: Callable[[Any, Any], Any]) -> Episode:
    """Verify (unless the sandbox already failed), close the sandbox, build the Episode."""
    success, passed, total, checks, meta = False, 0, 0, {}, {"index": run.index}
    if run.error is None and run.sandbox is not None:
        try:
            res = verify(run.sandbox, run.task)
            success, passed, total, checks = bool(res.success), int(res.passed), int(res.total), dict(res.checks)
            meta["verifier_tail"] = (res.output_tail or "")[-2000:]
            if res.error:  # e.g. test.sh timed out: S, P, C still stand as the verifier judged
                meta["verifier_error"] = res.error
        except Exception as e:  # a verifier crash is a failed episode, recorded, not a crash of the run
            logger.warning("episode %d (%s): verifier failed: %s: %s", run.index, run.task.task_id, type(e).__name__, e)
            run.error = f"verifier failed: {type(e).__name__}: {e}"
    _close(run)
    meta["wall_s"] = round(time.monotonic() - run.started, 3)
    meta["command_s"] = round(run.used_s, 3)
    if run.turns == 0:  # never acted (the sandbox did not open): nothing to train on
        meta["no_action"] = True
    return Episode(
        task_id=run.task.task_id,
        family=getattr(run.task, "family", ""),
        difficulty=getattr(run.task, "difficulty", ""),
        token_ids=run.ids,
        logprobs=run.logprobs,
        action_mask=run.mask,
        turn_ids=run.turn_ids,
        turns=run.turns,
        success=success,
        passed=passed,
        total=total,
        stop_reason=run.stop_reason or "done",
        parse_errors=run.parse_errors,
        checks=checks,
        transcript=run.transcript,
        prompt_len=run.prompt_len,
        error=run.error,
        meta=meta,
    )


# ---------------------------------------------------------------- ATIF export


ATIF_VERSION = "ATIF-v1.4"


def episode_to_atif(ep: Episode, model_name: str = "minirsi", instruction: str | None = None) -> dict[str, Any]:
    """One episode as an ATIF trajectory (Harbor's Agent Trajectory Interchange Format, v1.4).

    Steps: the system prompt, the user instruction (when given), then one agent step per action
    with its shell blocks as ``tool_calls`` (function ``bash``), the observation shown to the
    agent, and ``metrics`` with the exact ``completion_token_ids`` and ``logprobs`` of the
    action (read back from ``token_ids``/``action_mask``/``turn_ids``).
    """
    steps: list[dict[str, Any]] = [{"step_id": 1, "source": "system", "message": actions.SYSTEM_PROMPT}]
    if instruction is not None:
        steps.append({"step_id": 2, "source": "user", "message": instruction})
    for k, turn in enumerate(ep.transcript):
        pos = [t for t, (m, tid) in enumerate(zip(ep.action_mask, ep.turn_ids)) if m and tid == k]
        calls = [
            {"tool_call_id": f"call_{k}_{j}", "function_name": "bash", "arguments": {"command": c}}
            for j, c in enumerate(turn.get("commands", []))
        ]
        step: dict[str, Any] = {
            "step_id": len(steps) + 1,
            "source": "agent",
            "model_name": model_name,
            "message": turn.get("action", ""),
            "metrics": {
                "prompt_tokens": pos[0] if pos else None,
                "completion_tokens": len(pos),
                "completion_token_ids": [ep.token_ids[t] for t in pos],
                "logprobs": [ep.logprobs[t] for t in pos],
            },
        }
        if calls:
            step["tool_calls"] = calls
        if turn.get("observation") is not None:
            src = calls[-1]["tool_call_id"] if calls else None
            step["observation"] = {"results": [{"source_call_id": src, "content": turn["observation"]}]}
            step["extra"] = {"observation_in_training_sequence": bool(turn.get("shown"))}
        steps.append(step)
    return {
        "schema_version": ATIF_VERSION,
        "session_id": f"{ep.task_id}-{ep.meta.get('index', 0)}",
        "agent": {"name": "minirsi", "version": "0.1.0", "model_name": model_name},
        "steps": steps,
        "final_metrics": {
            "total_completion_tokens": sum(ep.action_mask),
            "total_steps": len(steps),
            "extra": {"success": ep.success, "passed": ep.passed, "total": ep.total, "stop_reason": ep.stop_reason},
        },
        "extra": {"task": ep.task_id, "family": ep.family, "error": ep.error, "checks": ep.checks},
    }


def export_atif(
    episodes: Sequence[Episode], path: str | Path, model_name: str = "minirsi", instructions: dict[str, str] | None = None
) -> list[Path]:
    """Write one ATIF ``<n>-<task>.json`` file per episode into directory ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, ep in enumerate(episodes):
        p = out / f"{n:05d}-{ep.task_id}.json"
        traj = episode_to_atif(ep, model_name, (instructions or {}).get(ep.task_id))
        p.write_text(json.dumps(traj, indent=1, ensure_ascii=False))
        paths.append(p)
    return paths


# ---------------------------------------------------------------- CLI


def cli(argv: list[str] | None = None, command: str = "rollout") -> int:
    parser = argparse.ArgumentParser(
        prog=f"minirsi {command}", description="Run the agent on tasks and write episodes as JSONL."
    )
    parser.add_argument("--model", required=True, help="model directory or name (its tokenizer renders prompts)")
    parser.add_argument("--tasks", required=True, help="directory of task directories (Harbor layout)")
    parser.add_argument("--episodes", type=int, default=None, help="episodes to run, cycling over the tasks (default: one per task)")
    parser.add_argument("--out", required=True, help="JSONL file; episodes are appended as they finish")
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="sandbox backend (default from config: bwrap)")
    parser.add_argument("--server", action="append", default=None, metavar="URL",
                        help="OpenAI-compatible server URL (vllm serve / minirsi serve); repeat it for several, "
                             "each episode pinned to one; default: generate in-process")
    parser.add_argument("--served-model-name", default=None, help="model name sent to --server (default: --model)")
    parser.add_argument("--config", default=None, help="YAML file with RolloutConfig fields")
    parser.add_argument("--atif", default=None, help="also export ATIF trajectories to this directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help="RolloutConfig overrides, e.g. max_turns=4 temperature=0.7")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    overrides = list(args.overrides) + ([f"backend={args.backend}"] if args.backend else [])
    cfg = load_config(RolloutConfig, args.config, overrides)
    tasks, errors = load_tasks(args.tasks)
    for e in errors:
        logger.warning("skipping task: %s", e)
    if not tasks:
        parser.error(f"--tasks {args.tasks}: no valid task found")
    tasks = sorted(tasks, key=lambda t: t.task_id)
    n = args.episodes if args.episodes is not None else len(tasks)
    if n < 1:
        parser.error("--episodes must be >= 1")
    chosen = list(itertools.islice(itertools.cycle(tasks), n))

    if args.server:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        sampler: Sampler = OpenAISampler(args.server, args.served_model_name or args.model)
    else:
        model, tokenizer = load_actor(args.model, device=args.device)
        sampler = HFSampler(model, tokenizer)
    stats = RolloutStats()
    episodes = collect(chosen, sampler, tokenizer, cfg, out_path=args.out, progress=not args.no_progress, stats=stats)
    if args.atif:
        export_atif(episodes, args.atif, args.served_model_name or args.model, {t.task_id: t.instruction for t in tasks})
    ok = sum(e.success for e in episodes)
    print(
        f"{len(episodes)} episodes -> {args.out}: success {ok}/{len(episodes)}, "
        f"{stats.wall_s:.1f}s ({100 * stats.outside_generation:.0f}% outside generation)"
    )
    return 0


# ------------------------------------------------- the callables the core stages take


def make_rollout_fn(tokenizer: Any, rollout_cfg: Any, sampler_factory: Callable[..., Any] | None = None,
                    progress: bool = True, journal: str | Path | None = None) -> RolloutFn:
    """RPR's and RSR's default ``rollout_fn`` (``rpr.RolloutFn``): an ``HFSampler`` on the current
    actor, then ``collect``.

    ``rollout_cfg`` is the rollout helper's config (turn limit, max tokens, backend...); its
    ``seed`` is replaced per call. ``sampler_factory(actor, tokenizer)`` builds the sampler.

    ``journal``: a directory where every call appends its episodes as they finish, to
    ``rollout-<seed>.jsonl`` (the seed names the call: one per RPR step). A call whose file is
    there already (a stage resumed after a kill or a dead server) takes the episodes it holds
    and collects only the others; a call whose file is complete samples nothing. Replaying a
    stage's finished steps from their episodes gives the updates they gave (same episodes, same
    seeds), so a resumed stage loses no finished episode and collects none twice (``rundir``
    keeps the journal of an unfinished stage).
    """
    factory = sampler_factory or (lambda model, tok: HFSampler(model, tok))

    def rollout_fn(actor: nn.Module, tasks: Sequence[Any], seed: int) -> list[Episode]:
        cfg = dataclasses.replace(rollout_cfg, seed=seed) if hasattr(rollout_cfg, "seed") else rollout_cfg
        out_path, finished = None, {}
        if journal is not None:
            out_path = Path(journal) / f"rollout-{seed}.jsonl"
            finished = finished_in(out_path, tasks)
            if len(finished) == len(tasks):
                logger.info("rollout %d: all %d episodes from the journal %s", seed, len(tasks), out_path)
                return [finished[i] for i in range(len(tasks))]
            if finished:
                logger.info("rollout %d: %d of %d episodes from the journal %s; collecting the rest", seed,
                            len(finished), len(tasks), out_path)
        was_training = actor.training
        actor.eval()
        try:
            return collect(list(tasks), factory(actor, tokenizer), tokenizer, cfg, out_path=out_path,
                           progress=progress, finished=finished)
        finally:
            actor.train(was_training)

    return rollout_fn


def make_replay_fn(backend: str = "bwrap", command_timeout: float = 30.0,
                   open_sandbox: Callable[..., Any] | None = None,
                   verify: Callable[[Any, Any], Any] | None = None) -> ReplayFn:
    """RSR's replay (``rsr.ReplayFn``): ``sandbox.open_sandbox`` + ``verifier.verify`` (the env helper's)."""
    open_sandbox = open_sandbox or sandbox.open_sandbox
    verify = verify or verifier.verify

    def replay(task: Any, commands: Sequence[str]) -> Replay:
        outputs, codes = [], []
        with open_sandbox(task, backend=backend) as sb:
            for cmd in commands:
                r = sb.run(cmd, timeout=command_timeout)
                outputs.append(r.output)
                codes.append(r.exit_code)
            v = verify(sb, task)
        return Replay(list(commands), outputs, codes, bool(v.success), int(v.passed), int(v.total))

    return replay
