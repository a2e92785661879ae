"""Run under ``torchrun --nproc_per_node 2 tests/dist_stages.py CKPT OUT.json`` (tests/test_distributed.py
does): the warm-up and the evaluation of ``stages.RecipeRunner`` on 2 gloo ranks, with and
without inference servers, the sandboxes replaced by a stand-in ``rollout.collect`` that
records who sampled with what. CKPT holds an actor checkpoint (``actor/``). Rank 0 writes:

* whether the one-process loader (``stages.load_actor``: the whole model on ``cfg.device``)
  ran anywhere; before, rank 0 loaded the actor (and built the critic) whole on its device;
* what each rank's actor and critic hold: the share of their parameters that is local (1/2
  sharded, 1 whole), read where the stage uses them;
* who sampled: rank 0 only, in-process from an unsharded host copy without servers, on the
  servers (a stand-in sync that records the pushed weights) with them, rank 0 then keeping no
  copy at all (a weightless skeleton).

Not a pytest module: it needs a process group."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))

from minirsi.config import load_config  # noqa: E402
from minirsi.core import distributed  # noqa: E402
from minirsi.engine import rollout  # noqa: E402
from minirsi.run import stages  # noqa: E402
from minirsi.run.memplan import ScaleConfig  # noqa: E402
from minirsi.run.config import RunConfig  # noqa: E402
from minirsi.run.recipe import plan  # noqa: E402
from minirsi.run.rundir import RunDir, StageInputs  # noqa: E402
from test_rpr import synthetic_episode  # noqa: E402


def local_share(model: torch.nn.Module) -> float:
    """Local parameter elements / full parameter elements of ``model`` on this rank."""
    local = full = 0
    for p in model.parameters():
        full += p.numel()
        local += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return local / full


def main() -> None:
    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    world = distributed.init("cpu", ScaleConfig(activation_checkpointing=False))
    cfg = load_config(RunConfig, None, ["warmup.minibatch_size=2", "eval.k=1", "eval.suites=[core]"])
    run_ = RunDir(out.parent / "run")
    record: dict = {"world_size": world.size, "one_process_loads": 0, "collect": [], "pushed": [], "shares": {},
                    "actor_shares": []}

    def no_whole_load(*args, **kwargs):
        record["one_process_loads"] += 1
        raise AssertionError("stages.load_actor ran: a whole model on cfg.device")

    stages.load_actor = no_whole_load
    tasks = [SimpleNamespace(task_id=f"t{i}", family="f", difficulty="easy") for i in range(4)]

    def collect(task_list, sampler, tok, rcfg, out_path=None, progress=True):
        model = getattr(sampler, "model", None)
        record["collect"].append({"rank": world.rank, "sampler": type(sampler).__name__,
                                  "model_share": None if not isinstance(model, torch.nn.Module) else local_share(model)})
        rng = random.Random(0)
        eps = [synthetic_episode(rng, 2) for _ in task_list]
        for e, t in zip(eps, task_list):
            e.task_id, e.success, e.passed, e.total = t.task_id, True, 1, 2
        return eps

    rollout.collect = collect
    warmup_critic = stages.warmup_critic

    def watched_warmup(critic, *args, **kwargs):
        record["shares"].setdefault("warmup_critic", []).append(world.all_sum(local_share(critic)) / world.size)
        return warmup_critic(critic, *args, **kwargs)

    stages.warmup_critic = watched_warmup
    load_actor_sharded = stages.load_actor_sharded

    def watched_actor(*args, **kwargs):
        # the sharded actor the stage samples or pushes from; rank 0's unsharded host copy (no
        # servers) is a separate module in world.shadows, its share seen by ``collect``
        actor, tok = load_actor_sharded(*args, **kwargs)
        record["actor_shares"].append({"rank": world.rank, "share": local_share(actor)})
        return actor, tok

    stages.load_actor_sharded = watched_actor

    class FakeSync:
        """What the stages need of WeightSync: called with the gathered plain actor; a sampler."""

        sampler = SimpleNamespace(name="servers")

        def __call__(self, plain):
            record["pushed"].append({"rank": world.rank, "model_share": local_share(plain),
                                     "params": sum(p.numel() for p in plain.parameters())})
            return {"sync_s": 0.0}

    for servers in (False, True):
        runner = stages.RecipeRunner()
        runner._tasks = {"train": tasks, "core": tasks}
        runner.scales = lambda run_: {"f": 2.0}
        runner._servers = (lambda cfg, run_: FakeSync()) if servers else (lambda cfg, run_: None)
        spec = dataclasses.replace({s.name: s for s in plan(cfg)}["warmup"], name=f"warmup{int(servers)}")
        stage_dir = run_.stage(spec)
        if world.is_main:
            stage_dir.mkdir(parents=True)
        world.barrier()
        inputs = StageInputs(actor=ckpt / "actor", critic=None, optimizer=None, rng=None)
        runner._warmup(cfg, run_, spec, inputs, stage_dir if world.is_main else out.parent / f"scratch{world.rank}",
                       lambda step, m: None)
        record[f"warmup_kept_{int(servers)}"] = world.all_sum(float(len(world.shadows) + len(world.skeletons)))
        results = runner.evaluate(cfg, run_, spec, ckpt / "actor", out.parent / f"eval{world.rank}{int(servers)}")
        record[f"eval_{int(servers)}"] = results["core"]["n_episodes"]
        record[f"eval_kept_{int(servers)}"] = world.all_sum(float(len(world.shadows) + len(world.skeletons)))
    gathered = [None] * world.size
    torch.distributed.all_gather_object(gathered, record)
    if world.is_main:
        merged = gathered[0]
        for other in gathered[1:]:
            merged["one_process_loads"] += other["one_process_loads"]
            merged["collect"] += other["collect"]
            merged["pushed"] += other["pushed"]
            merged["actor_shares"] += other["actor_shares"]
        out.write_text(json.dumps(merged, indent=1))
    distributed.shutdown()
    distributed.exit_rank(0)


if __name__ == "__main__":
    main()
