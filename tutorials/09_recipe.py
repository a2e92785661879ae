"""Tutorial 9: the five-stage recipe and its report, end to end on a toy budget.
(modules: minirsi/run/recipe.py, minirsi/run/stages.py, minirsi/run/rundir.py, minirsi/run/report.py, minirsi/presets/)

Run:  python tutorials/09_recipe.py      (15-30 seconds on a 2-core CPU; needs the bubblewrap
                                           sandbox of scripts/setup.sh)

docs/method.md section 7: Base -> RSR-1 -> RPR-1 -> RSR-2 -> RPR-2, each stage with its own
learning rates, each saved and evaluated with Mean@k. Between RSR-1 and RPR-1 a Warm-up Critic
Model trains the critic alone on rollouts of the frozen RSR-1 actor; from there the critic is
handed on: RPR-1 trains it, RSR-2 passes it through untouched, RPR-2 starts from it.

``minirsi run --preset smoke`` is the CI-sized run (a 1,000-step Base, then minutes of
training). This lesson runs the same driver, ``recipe.run``, on a config shrunk until it
fits in seconds: a 20-step Base, 4 training tasks, one calibration and one joint PPO step per
RPR stage. At that size nothing is expected to learn: the lesson is the mechanics, the
run directory, the critic's journey through it, results.json and report.md. The same config as
a command:

    minirsi run --out runs/tiny <the key=value overrides in OVERRIDES below>
"""

import json
import logging
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # fewer progress bars (those that do not set `disable` themselves)
from minirsi.config import load_config  # noqa: E402
from minirsi.run import recipe, report  # noqa: E402
from minirsi.run.config import RunConfig  # noqa: E402

logging.basicConfig(level=logging.WARNING)  # the driver logs every stage at INFO
OVERRIDES = [
    "threads=1", "suites.train=4", "suites.core=4", "suites.hard=1", "suites.long=1", "suites.unseen=1",
    # Base: a 20-step pretraining of the tiny model on a small corpus
    "base.pretrain.sessions=400", "base.pretrain.val_sessions=8", "base.pretrain.max_steps=20",
    "base.pretrain.batch_size=8", "base.pretrain.vocab_size=1024", "base.pretrain.threads=1",
    "rollout.max_turns=2", "rollout.max_new_tokens=24", "rollout.max_context_tokens=1024",
    "rollout.command_timeout=10",
    "rsr1.samples_per_task=2", "rsr1.planner_max_new_tokens=24", "rsr1.epochs=1", "rsr1.lr=1e-3",
    "rsr2.samples_per_task=2", "rsr2.planner_max_new_tokens=24", "rsr2.epochs=1", "rsr2.lr=5e-4",
    "warmup.minibatch_size=4", "warmup.lr_critic=1e-3",
    "rpr1.steps=1", "rpr1.critic_calibration_updates=1", "rpr1.episodes_per_step=4", "rpr1.minibatch_size=4",
    "rpr1.lr_actor=3e-4", "rpr1.lr_critic=1e-3", "rpr1.reward=fdr",
    "rpr2.steps=1", "rpr2.critic_calibration_updates=1", "rpr2.episodes_per_step=4", "rpr2.minibatch_size=4",
    "rpr2.lr_actor=3e-4", "rpr2.lr_critic=1e-3", "rpr2.reward=spr",
    "baselines.direct_ppo=false",
    "eval.k=3", "eval.suites=[core,long]", "eval.rollout.max_turns=2", "eval.rollout.max_new_tokens=24",
    "eval.rollout.command_timeout=10",
]
cfg = load_config(RunConfig, None, OVERRIDES)

# 1. The plan: which stage starts from which actor and which critic.
print("1. the stage plan")
stages = recipe.plan(cfg)
for s in stages:
    print(f"   {s.dirname:<10} {s.label:<15} actor from {s.actor_from or '-':<7} critic from {s.critic_from or '-'}")
assert [s.name for s in stages] == ["base", "rsr1", "warmup", "rpr1", "rsr2", "rpr2"]
assert {s.name: s.critic_from for s in stages} == {"base": None, "rsr1": None, "warmup": None, "rpr1": "warmup",
                                                   "rsr2": "rpr1", "rpr2": "rsr2"}
# Each stage carries its finished config: its own seed, and the warm-up's discount is RPR-1's,
# since the critic it trains is the baseline of RPR-1's returns.
by_name = {s.name: s for s in stages}
warm = by_name["warmup"].config
print(f"   warm-up: gamma_turn {warm.gamma_turn}, lam_turn {warm.lam_turn} (RPR-1's); seeds "
      + ", ".join(f"{s.name} {s.config.seed}" for s in stages if s.config is not None))
assert (warm.gamma_turn, warm.lam_turn) == (by_name["rpr1"].config.gamma_turn, by_name["rpr1"].config.lam_turn)

# 2. The run: every stage trains, is checkpointed, then evaluated (the warm-up only trains).
run_dir = Path(tempfile.mkdtemp(prefix="minirsi-tutorial-")) / "tiny"
results = recipe.run(cfg, run_dir, tensorboard=False)
print(f"\n2. run directory {run_dir}:")
for d in sorted((run_dir / "stages").iterdir()):
    parts = sorted(p.name for p in d.iterdir() if p.name in ("actor", "critic", "optimizer.pt", "rng.pt", "DONE.json"))
    print(f"   stages/{d.name:<10} {' '.join(parts)}")
    # every stage directory holds a full checkpoint (what a stage did not change is hard-linked in)
    assert {"actor", "DONE.json", "rng.pt"} <= set(parts)
    assert ("critic" in parts) == (d.name >= "02"), "a critic exists from the warm-up on"
    assert ("optimizer.pt" in parts) == (d.name >= "01"), "Base trains nothing the recipe resumes"
assert (run_dir / "calibration.json").is_file() and (run_dir / "config.yaml").is_file()


def files(d: Path) -> dict:
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# 3. The critic's journey: none before the warm-up; RSR-2's critic is RPR-1's, bit for bit.
st = run_dir / "stages"
handed_on = files(st / "04-rsr2" / "critic") == files(st / "03-rpr1" / "critic")
trained = files(st / "03-rpr1" / "critic") != files(st / "02-warmup" / "critic")
print(f"\n3. critic: none in RSR-1: {not (st / '01-rsr1' / 'critic').exists()}; RPR-1 trained the warm-up's: "
      f"{trained}; RSR-2 hands RPR-1's on untouched: {handed_on}")
assert not (st / "01-rsr1" / "critic").exists() and trained and handed_on

# 4. What each stage did (DONE.json's stats) and the training signals (metrics.jsonl).
done = {d.name: json.loads((d / "DONE.json").read_text()) for d in sorted(st.iterdir())}
rsr1, warm, rpr1 = done["01-rsr1"]["stats"], done["02-warmup"]["stats"], done["03-rpr1"]["stats"]
print(f"\n4. RSR-1: {rsr1['runs_verified']} of {rsr1['runs_sampled']} runs verified, {rsr1['sft_examples']} "
      f"SFT examples\n   warm-up: {warm['episodes']} episodes, explained variance {warm['ev_first']:.3f} -> "
      f"{warm['ev_last']:.3f}\n   RPR-1: {rpr1['steps']} updates (calibration + joint), final binary reward "
      f"{rpr1['final_binary_reward']:.3f}")
assert 0 <= rsr1["runs_verified"] <= rsr1["runs_sampled"] == 2 * cfg.suites.train
assert 0 <= rsr1["sft_examples"] <= rsr1["runs_verified"]
assert warm["episodes"] >= 1 and warm["ev_first"] <= 1 and warm["ev_last"] <= 1
assert rpr1["steps"] == cfg.rpr1.critic_calibration_updates + cfg.rpr1.steps
assert 0 <= rpr1["final_binary_reward"] <= 1
lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
per_stage = {name: sum(1 for x in lines if x["stage"] == name) for name in ("rsr1", "warmup", "rpr1", "rsr2", "rpr2")}
print("   metrics.jsonl lines per stage:", per_stage)
assert per_stage["rpr1"] == per_stage["rpr2"] == 2 and per_stage["rsr1"] == per_stage["rsr2"] == 1
assert per_stage["warmup"] == warm["updates"] >= 1  # one line per warm-up update

# 5. results.json: stage -> suite -> Mean@3 and its breakdowns; report.md renders it.
print("\n5. results.json: Mean@3 on core; process reward and strict completion on long")
for stage, by_suite in results.items():
    core, long = by_suite["core"], by_suite["long"]
    print(f"   {stage:<5} Mean@3 {core['mean_at_3']:.3f} over {core['n_episodes']} episodes; long: process reward "
          f"{long['process_reward']:.3f}, strict completion {long['strict_completion']}")
    assert 0 <= core["mean_at_3"] <= 1 and core["n_episodes"] == 3 * cfg.suites.core
    assert 0 <= long["process_reward"] <= 1
    assert 0 <= long["strict_completion"]["completed"] <= long["strict_completion"]["tasks"] == cfg.suites.long
assert list(results) == ["base", "rsr1", "rpr1", "rsr2", "rpr2"]
assert json.loads((run_dir / "results.json").read_text()) == results
path = report.write_report(run_dir)
text = path.read_text()
print(f"\n{path.name}, its first table:\n")
print(text.split("## By difficulty")[0].strip())
assert all(label in text for label in ("Base", "RSR-1", "RPR-1", "RSR-2", "RPR-2"))
assert (run_dir / "success.png").is_file()
