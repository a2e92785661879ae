"""Run under ``torchrun --nproc_per_node 2 tests/dist_load.py DIR OUT.json`` (tests/test_distributed.py
does): checkpoints loaded straight into shards (``World.load_sharded``: rank 0 reads, rank 1
builds on the meta device) against a plain one-process ``from_pretrained`` on every rank, one
PPO update after each way of loading, and a model sharded without an unsharded copy (servers
sample) gathered for a push and a save. Rank 0 writes every difference to OUT.json; DIR holds
the checkpoints the test wrote. Not a pytest module: it needs a process group."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from minirsi.core import distributed  # noqa: E402
from minirsi.core.critic import build_critic, load_critic, load_critic_sharded  # noqa: E402
from minirsi.core.distributed import max_abs_diff  # noqa: E402
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch  # noqa: E402
from minirsi.engine.models import LoraSettings, actor_skeleton, load_actor, load_actor_sharded  # noqa: E402
from test_rpr import synthetic_episode  # noqa: E402


def buffers_diff(world: distributed.World, sharded: torch.nn.Module, plain: torch.nn.Module) -> float:
    """max |buffer - plain's buffer| over this rank's buffers, summed over the ranks (0 iff equal
    everywhere); the names must match too."""
    mine = {distributed._plain_key(k): v for k, v in sharded.named_buffers()}
    ref = dict(plain.named_buffers())
    if set(mine) != set(ref) or not mine:
        raise AssertionError(f"rank {world.rank}: buffer names differ: {sorted(set(mine) ^ set(ref))}")
    return world.all_sum(max(float((mine[k].float() - ref[k].float()).abs().max()) for k in ref))


def state_diff(world: distributed.World, sharded: torch.nn.Module, plain: torch.nn.Module) -> float | None:
    """max |gathered full state - plain state| (rank 0; None elsewhere); every rank calls it."""
    full = world.full_state_dict(sharded)
    if not world.is_main:
        return None
    ref = plain.state_dict()
    return max_abs_diff({k: full[k] for k in full}, {k: ref[k] for k in full}) if set(full) <= set(ref) else 1.0


def main() -> None:
    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    world = distributed.init("cpu")
    result: dict[str, float | list] = {"world_size": world.size}
    actor_dir, critic_dir = ckpt / "actor", ckpt / "critic"

    # -- the actor, plain and LoRA, and with activation checkpointing ---------------------------
    plain, _ = load_actor(actor_dir)  # every rank: the one-process reference
    actor, tok = load_actor_sharded(actor_dir, world)
    result["actor_state"] = state_diff(world, actor, plain)
    result["actor_buffers"] = buffers_diff(world, actor, plain)
    result["actor_training"] = world.all_sum(float(actor.training != plain.training))
    result["rank0_keeps_copy"] = world.all_sum(float(id(actor) in world.shadows))
    torch.manual_seed(5)  # LoRA's A is random: rank 0's load draws it, the others receive it
    plain_lora = load_actor(actor_dir, lora=LoraSettings(r=4))[0] if world.is_main else None
    torch.manual_seed(5)
    lora = load_actor_sharded(actor_dir, world, lora=LoraSettings(r=4))[0]
    d = world.full_state_dict(lora)
    if world.is_main:
        ref = plain_lora.state_dict()
        result["lora_state"] = max_abs_diff(d, {k: ref[k] for k in d})
        trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
        result["lora_trainable_not_lora"] = float(not trainable or any("lora_" not in n for n in trainable))
    ref, _ = load_actor_sharded(actor_dir, world, keep_unsharded=False, frozen=True)  # the KL reference
    result["reference_state"] = state_diff(world, ref, plain)
    result["reference_not_frozen"] = world.all_sum(float(ref.training or any(p.requires_grad for p in ref.parameters())))
    ac = dataclasses.replace(world, activation_checkpointing=True, shadows={}, skeletons={})
    wrapped, _ = load_actor_sharded(actor_dir, ac)
    result["checkpointed_state"] = state_diff(ac, wrapped, plain)
    result["checkpointed_buffers"] = buffers_diff(ac, wrapped, plain)

    # -- the critic: saved (load_critic), and built from the actor's checkpoint (build_critic) ----
    for name, source, ref in (("critic", critic_dir, load_critic(critic_dir)),
                              ("built_critic", actor_dir, build_critic(actor_dir))):
        critic = load_critic_sharded(source, world)
        result[f"{name}_state"] = state_diff(world, critic, ref)
        result[f"{name}_buffers"] = buffers_diff(world, critic, ref)
        result[f"{name}_training"] = world.all_sum(
            float(any(a.training != b.training for a, b in zip(critic.modules(), ref.modules()))))

    # -- one PPO update after each way of loading: the same update --------------------------------
    rng = random.Random(0)
    episodes = [synthetic_episode(rng, rng.randint(1, 3)) for _ in range(5)]
    rewards = [rng.random() for _ in episodes]
    cfg = RPRConfig(minibatch_size=4, grad_accum=2, ppo_epochs=1, lr_actor=1e-3, lr_critic=1e-3, seed=0)

    def update(a: torch.nn.Module, c: torch.nn.Module) -> tuple[dict, dict]:
        batch = prepare_batch(a, c, episodes, rewards, cfg, world=world)
        ppo_update(a, c, batch, cfg, make_optimizers(a, c, cfg), world=world)
        return world.full_state_dict(a), world.full_state_dict(c)

    old = update(world.shard(load_actor(actor_dir)[0]), world.shard(load_critic(critic_dir)))  # every rank loads
    new = update(load_actor_sharded(actor_dir, world)[0], load_critic_sharded(critic_dir, world))
    if world.is_main:
        result["ppo_actor"] = max_abs_diff(old[0], new[0])
        result["ppo_critic"] = max_abs_diff(old[1], new[1])
        start = plain.state_dict()
        result["ppo_moved"] = max_abs_diff(old[0], {k: start[k] for k in old[0]})

    # -- servers sample: no unsharded copy; a push gathers, builds, and lets go ----------------
    served, _ = load_actor_sharded(actor_dir, world, keep_unsharded=False)
    result["served_keeps_copy"] = world.all_sum(float(id(served) in world.shadows))
    seen: list = []
    roll = world.rollout_fn(lambda m, tasks, seed: seen.append(m) or [seed], gather=False)
    got = roll(served, [], 3)  # every rank: rank 0 runs it, the result is broadcast
    result["rollout_gets_sharded"] = world.all_sum(float(got == [3] and (seen == [] if world.rank else seen[0] is served)))
    pushed = world.unsharded(served)  # what _sharded_push hands to WeightSync
    if world.is_main:
        ids = torch.tensor([list(range(1, 40))])
        with torch.no_grad():
            logits_gap = (pushed(input_ids=ids).logits - plain.eval()(input_ids=ids).logits).abs().max()
        result["push_state"] = max_abs_diff(pushed.state_dict(), plain.state_dict())
        result["push_logits"] = float(logits_gap)
        result["push_tied"] = float(pushed.lm_head.weight is pushed.model.embed_tokens.weight)
        result["push_frozen"] = float(not any(p.requires_grad for p in pushed.parameters()))
    del pushed
    world.save(served, lambda m: m.save_pretrained(out.with_suffix(".served"), safe_serialization=True))
    if world.is_main:
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(out.with_suffix(".served"))
        result["served_save"] = max_abs_diff(back.state_dict(), plain.state_dict())

    # -- a rank-0 load failure reaches every rank (no rank waits at a collective) ----------------
    raised = 0.0
    try:
        world.load_sharded(lambda: load_actor(ckpt / "missing")[0], lambda: copy.deepcopy(plain))
    except (ValueError, RuntimeError) as e:
        raised, message = 1.0, str(e)
    result["failure_raised"] = world.all_sum(raised)  # 2: both ranks
    if world.is_main:
        result["failure_message"] = message[:200]
    raised = 0.0  # a build() that does not match the checkpoint (fp64 against fp32) is refused everywhere
    try:
        world.load_sharded(lambda: load_actor(actor_dir)[0], lambda: actor_skeleton(actor_dir, dtype=torch.float64))
    except ValueError as e:
        raised, message = 1.0, str(e)
    result["mismatch_raised"] = world.all_sum(raised)
    if world.is_main:
        result["mismatch_message"] = message[:300]

    if world.is_main:
        out.write_text(json.dumps(result, indent=1))
    distributed.shutdown()
    distributed.exit_rank(0)  # skip the interpreter's teardown (minirsi.core.distributed.exit_rank)


if __name__ == "__main__":
    main()
