"""Tutorial 8: Recursive Self-Rewrite, from a verified run to supervised data on action tokens.
(modules: minirsi/core/rsr.py, minirsi/core/actions.py, minirsi/engine/rollout.py, minirsi/core/critic.py)

Run:  python tutorials/08_self_rewrite.py      (5-10 seconds on a 2-core CPU; needs the
                                                 bubblewrap sandbox of scripts/setup.sh)

RSR (docs/method.md section 6) trains the actor alone on its own successes, made cleaner:

  verified run -> clean the transcript -> a planner rewrites it -> replay the rewrite in a
  FRESH sandbox and keep it only if the verifier passes again -> SFT, cross-entropy on the
  action tokens only. The critic is not an argument of any of it.

An untrained tiny model never passes a verifier, so the run RSR starts from is played by a
scripted agent through the real harness (rollout.collect: the same sandbox, verifier and
transcript an actor's run gets). It wanders the way a weak agent does: an inspection, a
command that fails, the same inspection again, the task's real commands, one more look, done.
"""

import tempfile
from pathlib import Path

import torch

import toy_envs
from minirsi.core import actions
from minirsi.core.critic import build_critic, fingerprint
from minirsi.core.rsr import RSRConfig, ReplayMinimiser, clean_transcript, render_rewrite, run_rsr, sft_loss
from minirsi.engine.models import build_tiny_actor, build_tokenizer
from minirsi.engine.rollout import RolloutConfig, collect, make_replay_fn
from minirsi.engine.sampler import HFSampler, Sample
from minirsi.env.tasks import load_task
from minirsi.run.pretrain import corpus_sessions, session_text

torch.manual_seed(0)
tokenizer = build_tokenizer([session_text(s) for s in corpus_sessions(200, seed=0)], vocab_size=1024)
actor = build_tiny_actor(tokenizer, preset="tiny", seed=0)
critic = build_critic(actor)  # built from the actor, as the recipe's warm-up does; RSR never sees it

work = Path(tempfile.mkdtemp(prefix="minirsi-tutorial-"))
task = load_task(next(p for p in toy_envs.generate_suite("core", work, n=12, seed=0) if "files-easy" in p.name))
solution = [line for line in (task.path / "solution" / "solve.sh").read_text().splitlines()
            if line.strip() and not line.startswith(("#", "set "))]
print("task:", task.task_id, "|", task.instruction.strip())

REPLIES = ["```bash\nls\n```",
           "```bash\ncat notes.txt\n```",  # fails: there is no such file
           "```bash\nls\n```",  # the same inspection again
           "\n".join(f"```bash\n{c}\n```" for c in solution),  # the oracle's commands, one block each
           "```bash\npwd\n```",
           actions.COMPLETE]


class ScriptedAgent:
    """A Sampler that answers turn k of every episode with REPLIES[k] (log-probs are not used by RSR)."""

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seed=None):
        out = []
        for prompt in prompts:
            k = tokenizer.decode(prompt).count("<|im_start|>assistant") - 1  # assistant turns already taken
            ids = actions.render_action_ids(tokenizer, REPLIES[k])  # ends with <|im_end|>, the stop id
            out.append(Sample(ids, [0.0] * len(ids), "stop"))
        return out


def scripted_rollouts(model, tasks, seed):
    """RSR's ``rollout_fn(actor, tasks, seed)``, played by the script instead of ``model``."""
    cfg = RolloutConfig(max_turns=8, max_new_tokens=64, max_context_tokens=1024, command_timeout=10.0, seed=seed)
    return collect(tasks, ScriptedAgent(), tokenizer, cfg, progress=False)


# 1. The verified run: it passed the verifier, with detours.
(run,) = scripted_rollouts(actor, [task], seed=0)
print(f"\n1. run: {run.turns} turns, S={int(run.success)} P={run.passed}/{run.total}")
statuses = []
for turn in run.transcript:
    statuses.append(((turn.get("observation") or "").strip().splitlines() or ["(no command)"])[-1])
    print(f"   {turn.get('commands') or actions.COMPLETE!s:<40} {statuses[-1]}")
assert run.success and run.turns == len(REPLIES)
assert statuses[:5] == ["[exit 0]", "[exit 1]", "[exit 0]", "[exit 0]", "[exit 0]"]  # the detour failed

# 2. Cleaning: failed blocks, repeats and repeated inspections go (rules: minirsi/core/rsr.py's docstring);
#    a failure the run later recovered from (the same command run again, exit 0) would stay.
cleaned = clean_transcript(run.transcript)
print("\n2. cleaned:", [s.command for s in cleaned])
assert [s.command for s in cleaned] == ["ls", *solution, "pwd"]

# 3. The planner rewrites it. ReplayMinimiser drops one command at a time (last first) and keeps
#    the drop when a fresh sandbox still passes; each replay below is a new sandbox.
replays = []
real_replay = make_replay_fn("bwrap", command_timeout=10.0)


def replay(task_, commands):
    result = real_replay(task_, commands)
    replays.append((list(commands), result.success))
    return result


rewrite = ReplayMinimiser(replay).rewrite(task, cleaned)
print(f"\n3. rewrite: {rewrite}  ({len(replays)} fresh-sandbox replays)")
for commands, ok in replays:
    print(f"   replay {commands!s:<40} S={int(ok)}")
assert len(replays) == len(cleaned) + 1 and set(rewrite) <= set(solution) and len(rewrite) < len(cleaned)
assert replays[0] == ([s.command for s in cleaned], True) and (rewrite, True) in replays

# 4. Re-verification: the rewrite is replayed once more in a fresh sandbox; only a pass is kept.
kept = real_replay(task, rewrite)
broken = real_replay(task, ["ls"])  # what a bad planner might write
print(f"\n4. re-verified rewrite: S={int(kept.success)} P={kept.passed}/{kept.total}; "
      f"a rewrite without the real step: S={int(broken.success)} P={broken.passed}/{broken.total} (rejected)")
assert kept.success and kept.passed == kept.total and not broken.success

# 5. SFT data: the rewrite rendered as a fresh session (instruction, one ```bash turn per command
#    answered by the replay's own output, then TASK_COMPLETE); the loss reads action tokens only.
ids, mask, _ = render_rewrite(tokenizer, task, kept)
print(f"\n5. SFT sequence: {len(ids)} tokens, {sum(mask)} of them action tokens")
assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") and mask[-1] == 1  # ends on an action
actions_text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
print("   the action tokens read:", repr(actions_text))
assert actions_text.count(actions.COMPLETE) == 1 and all(c in actions_text for c in rewrite)
x, m = torch.tensor([ids]), torch.tensor([mask], dtype=torch.float32)
with torch.no_grad():
    ours = sft_loss(actor, x, torch.ones_like(x), m)
    labels = torch.where(m.bool(), x, torch.tensor(-100))  # transformers' "ignore this target"
    theirs = actor(input_ids=x, labels=labels).loss
print(f"   SFT loss {ours.item():.4f} = transformers' loss with labels -100 off the actions {theirs.item():.4f}")
assert torch.allclose(ours, theirs, atol=1e-5)

# 6. The whole stage, as the recipe calls it: run_rsr(actor, tokenizer, tasks, cfg, rollout_fn,
#    replay_fn, sampler_factory=HFSampler): the core stage takes the engine's callables (a fresh
#    sandbox per replay, the in-process sampler its LLM planner samples with).
#    Its planner is the actor itself ("self"): an untrained one writes no passing rewrite, so the
#    cleaned transcript is replayed as the fallback. The critic is not passed, and stays as it was.
actor_before, critic_before = fingerprint(actor), fingerprint(critic)
cfg = RSRConfig(samples_per_task=2, planner="llm", planner_max_new_tokens=48, lr=1e-3, epochs=4, batch_size=2,
                command_timeout=10.0, seed=0)
stats = run_rsr(actor, tokenizer, [task], cfg, scripted_rollouts, make_replay_fn(cfg.backend, cfg.command_timeout),
                sampler_factory=HFSampler)
print(f"\n6. run_rsr: sampled {stats.runs_sampled}, verified {stats.runs_verified}, re-verified {stats.reverified} "
      f"({stats.from_fallback} from the cleaned fallback), {stats.sft_examples} distinct SFT example(s); "
      f"turns {stats.mean_turns_before:.1f} -> {stats.mean_turns_after:.1f}; "
      f"SFT loss {stats.sft_loss_first:.3f} -> {stats.sft_loss_last:.3f}")
assert stats.runs_sampled == stats.runs_verified == 2 and stats.reverified == 2
assert 0 <= stats.from_fallback <= stats.reverified and 1 <= stats.sft_examples <= stats.reverified
assert stats.mean_turns_after < stats.mean_turns_before and stats.sft_loss_last < stats.sft_loss_first
changed = fingerprint(actor) != actor_before
untouched = fingerprint(critic) == critic_before
print(f"   actor changed: {changed}; critic bit-identical: {untouched}")
assert changed and untouched
