"""Tutorial 5: one Recursive Policy-Refine update, piece by piece.
(modules: minirsi/core/rpr.py, minirsi/core/critic.py, minirsi/core/tb_gae.py, minirsi/core/spr.py)

Run:  python tutorials/05_policy_refine.py        (about half a minute on a laptop CPU)

RPR is PPO with three Terminal-RSI specifics (docs/method.md sections 5 and 6): the reward is FDR
or SPR of the verifier's result, placed on the last action token; advantages come from TB-GAE
over the critic's per-token values; and the critic is a separate value model that is carried
from stage to stage (saved, loaded, never reset). This script runs the pieces that
``rpr.run_rpr`` chains, on a few real rollouts of an untrained tiny model:

  rollouts -> verifier -> SPR -> critic values -> TB-GAE -> one PPO update -> critic handoff
"""

import math
import tempfile
from pathlib import Path

import torch

import toy_envs
from minirsi.core.critic import build_critic, fingerprint, load_critic, save_critic
from minirsi.core.fdr import calibrate
from minirsi.core.rpr import RPRConfig, logprob_gap, make_optimizers, ppo_update, prepare_batch, score
from minirsi.engine.models import build_tiny_actor, build_tokenizer
from minirsi.engine.rollout import RolloutConfig, collect
from minirsi.engine.sampler import HFSampler
from minirsi.env.tasks import load_task
from minirsi.run.pretrain import corpus_sessions, session_text

torch.manual_seed(0)
tokenizer = build_tokenizer([session_text(s) for s in corpus_sessions(200, seed=0)], vocab_size=1024)
actor = build_tiny_actor(tokenizer, preset="tiny", seed=0)
critic = build_critic(actor)  # a separate copy of the backbone + a zero-initialised value head

# 1. Rollouts and the verifier: 2 episodes on each of 4 toy tasks.
work = Path(tempfile.mkdtemp(prefix="minirsi-tutorial-"))
tasks = [load_task(p) for p in toy_envs.generate_suite("core", work, n=4, seed=0)] * 2
roll = RolloutConfig(max_turns=2, max_new_tokens=24, max_context_tokens=1024, seed=0)
episodes = collect(tasks, HFSampler(actor.eval(), tokenizer), tokenizer, roll, progress=False)
print("episodes (S, P/C):", [(int(e.success), f"{e.passed}/{e.total}") for e in episodes])
assert len(episodes) == 8 and all(0 <= e.passed <= e.total for e in episodes)

# 2. Rewards: SPR with a per-family scale frozen from the tasks' check counts.
scales = calibrate({e.family: [e.total] for e in episodes if e.total > 0})
rewards = score(episodes, "spr", scales)
print("SPR rewards:", [round(r, 3) for r in rewards])
assert all((r >= 1) == e.success for r, e in zip(rewards, episodes)), "SPR: successes >= 1 > failures"

# 3. Values, TB-GAE advantages, old log-probs: computed once, before any update.
cfg = RPRConfig(lr_actor=1e-3, lr_critic=1e-3, minibatch_size=4, ppo_epochs=1, gamma_turn=1.0, lam_turn=0.95)
batch = prepare_batch(actor, critic, episodes, rewards, cfg, pad_id=tokenizer.pad_token_id)
act = batch["action_mask"].bool()
print(f"batch {tuple(batch['input_ids'].shape)}: {int(act.sum())} action tokens; "
      f"advantages are 0 off-action: {bool((batch['advantages'][~act] == 0).all())}")
assert (batch["advantages"][~act] == 0).all()
assert batch["input_ids"].shape == (len(episodes), max(len(e.token_ids) for e in episodes))
assert int(act.sum()) == sum(sum(e.action_mask) for e in episodes)  # collate keeps every sampled token

# 4. One PPO update of actor and critic. The log-prob gap is a property of the batch (trainer vs
# sampler on the same ids, before the update), so it is read from the batch, not the update.
before = fingerprint(actor), fingerprint(critic)
metrics = ppo_update(actor, critic, batch, cfg, make_optimizers(actor, critic, cfg))
metrics["logprob_gap"] = logprob_gap(batch)
for k in ("policy_loss", "value_loss", "approx_kl", "clip_frac", "explained_variance", "entropy", "logprob_gap"):
    print(f"  {k:<20} {metrics[k]: .4g}")
assert all(math.isfinite(v) for v in metrics.values()), metrics
assert metrics["value_loss"] >= 0 and metrics["approx_kl"] >= 0 and metrics["entropy"] >= 0
assert 0 <= metrics["clip_frac"] <= 1
# The fresh critic's head is zero, so V_old = 0 and 1 - Var(R - V) / Var(R) is exactly 0.
assert abs(metrics["explained_variance"]) < 1e-6
assert metrics["logprob_gap"] < 1e-3, "the trainer scores the sampled ids as the sampler did"
assert fingerprint(actor) != before[0] and fingerprint(critic) != before[1], "both models were updated"

# 5. Handoff: the critic that ends one refine phase starts the next, bit for bit.
path = save_critic(critic, work / "critic")
assert fingerprint(load_critic(path)) == fingerprint(critic)
print("critic handed off unchanged:", fingerprint(critic)[:16])
