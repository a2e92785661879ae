"""Run under ``torchrun --nproc_per_node 2 tests/dist_scale.py OUT.json`` (tests/test_distributed.py
does): what the scale path changes, on 2 gloo ranks. Rank 0 writes every figure to OUT.json
(and OUT.optim.pt, the gathered optimizer state, for the one-process read in the test):

* settings: ``distributed.init`` with the run config's ``scale`` turns activation checkpointing
  on under torchrun (no FSDP variable set), and a disagreeing accelerate variable is refused;
* fp32 heads: ``fsdp2(bf16=True)`` computes the LM head (untied and tied) and the value head in
  fp32 from fp32 weights while the decoder layers run in bf16;
* deferred gradient sync: no reduce-scatter before the minibatch's last micro-batch, and the
  PPO update equals the per-micro-batch one;
* a sharded optimizer checkpoint (torch.distributed.checkpoint): every rank writes its own
  shards, a fresh pair of sharded optimizers loads them, and the next update equals the one
  the original optimizers make.

Not a pytest module: it needs a process group."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from minirsi.core import distributed  # noqa: E402
from minirsi.core.critic import build_critic, load_critic_sharded, save_critic  # noqa: E402
from minirsi.core.distributed import fsdp2, max_abs_diff  # noqa: E402
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch  # noqa: E402
from minirsi.engine.models import build_tokenizer, load_actor_sharded, save_actor  # noqa: E402
from minirsi.run.memplan import ScaleConfig  # noqa: E402
from test_rpr import synthetic_episode  # noqa: E402
from tiny import tiny_qwen  # noqa: E402


def head_dtypes(heads: list[torch.nn.Module], layer: torch.nn.Module, call) -> dict:
    """Run ``call()`` and report, at each head's forward, its weight's and input's dtype (read
    in a pre-hook, after FSDP's has gathered the weight) and how far its output is from an fp32
    matmul of the two; and a decoder layer's weight dtype."""
    seen: dict = {}

    def before(name):
        def hook(module, args):
            seen[name] = {"w": module.weight.detach().clone(), "x": args[0].detach().clone(),
                          "b": None if module.bias is None else module.bias.detach().clone()}
        return hook

    def after(name):
        def hook(module, args, output):
            w, x, b = (seen[name].pop(k) for k in ("w", "x", "b"))
            ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            seen[name].update(weight=str(w.dtype), input=str(x.dtype), output=str(output.dtype),
                              fp32_matmul=float((output.float() - ref).abs().max()))
        return hook

    handles = []
    for i, h in enumerate(heads):
        handles += [h.register_forward_pre_hook(before(f"head{i}")), h.register_forward_hook(after(f"head{i}"))]
    proj = next(m for m in layer.modules() if isinstance(m, torch.nn.Linear))
    handles.append(proj.register_forward_hook(lambda m, a, o: seen.update(layer=str(m.weight.dtype))))  # None: output kept
    with torch.no_grad():
        call()
    for h in handles:
        h.remove()
    return seen


def main() -> None:
    out = Path(sys.argv[1])
    result: dict = {}

    # -- settings from the run config, not from an accelerate variable ---------------------------
    os.environ.pop("FSDP_ACTIVATION_CHECKPOINTING", None)
    world = distributed.init("cpu", ScaleConfig(activation_checkpointing=True))
    result["world_size"] = world.size
    result["ckpt_from_config"] = float(world.activation_checkpointing)
    os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = "false"  # as accelerate sets it from a YAML that disagrees
    try:
        distributed.fsdp_settings(ScaleConfig(activation_checkpointing=True))
        result["conflict_refused"] = 0.0
    except ValueError as e:
        result["conflict_refused"], result["conflict_message"] = 1.0, str(e)[:300]
    del os.environ["FSDP_ACTIVATION_CHECKPOINTING"]
    sharded = world.shard(tiny_qwen(seed=0), keep_unsharded=False)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    result["wrapped_layers"] = sum(isinstance(m, CheckpointWrapper) for m in sharded.modules())

    # -- fp32 heads under bf16 ---------------------------------------------------------------------
    ids = torch.arange(1, 30)[None]
    untied = tiny_qwen(seed=0)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())  # untie
    untied.config.tie_word_embeddings = False
    critic = build_critic(untied, head_init_std=0.1)
    tied = tiny_qwen(seed=0)
    for name, model in (("untied", untied), ("tied", tied), ("critic", critic)):
        heads = [model.head] if name == "critic" else [model.lm_head]
        layer = (model.backbone if name == "critic" else model.model).layers[0]
        fsdp2(model, bf16=True)
        call = (lambda m=model: m(ids, torch.ones_like(ids))) if name == "critic" else (lambda m=model: m(input_ids=ids))
        result[f"heads_{name}"] = head_dtypes(heads, layer, call)

    # -- deferred gradient sync ----------------------------------------------------------------------
    rng = random.Random(0)
    episodes = [synthetic_episode(rng, rng.randint(1, 3)) for _ in range(6)]
    rewards = [rng.random() for _ in episodes]
    # micro-batches of 3 rows: rank 0 trains on 2 rows of different lengths (padding, a 4-D mask)
    cfg = RPRConfig(minibatch_size=6, grad_accum=2, ppo_epochs=1, lr_actor=1e-3, lr_critic=1e-3, seed=0)
    base_actor, base_critic = tiny_qwen(seed=1), build_critic(tiny_qwen(seed=1), head_init_std=0.1)
    deferred = dataclasses.replace(world, defer_grad_sync=True, shadows={}, skeletons={})
    m = deferred.shard(copy.deepcopy(base_actor), keep_unsharded=False)
    batch = {"input_ids": torch.randint(1, 300, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    deferred.grad_sync([m], last=False)
    m(**deferred.local(batch)).logits.float().pow(2).mean().backward()
    result["grads_after_first_micro_batch"] = world.all_sum(float(sum(p.grad is not None for p in m.parameters())))
    deferred.grad_sync([m], last=True)
    m(**deferred.local(batch)).logits.float().pow(2).mean().backward()
    result["grads_after_last_micro_batch"] = world.all_sum(float(sum(p.grad is not None for p in m.parameters())))

    saved = out.parent / "saved"
    if world.is_main:  # loaded from disk, as the stages load them (a loaded model's forward is the one to test)
        tok = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
        save_actor(base_actor, tok, saved / "actor")
        save_critic(base_critic, saved / "critic")
    world.barrier()

    def update(w: distributed.World) -> tuple[dict, dict, object]:
        a = load_actor_sharded(saved / "actor", w, keep_unsharded=False)[0]
        c = load_critic_sharded(saved / "critic", w)
        opts = make_optimizers(a, c, cfg)
        b = prepare_batch(a, c, episodes, rewards, cfg, world=w)
        ppo_update(a, c, b, cfg, opts, world=w)
        return a, c, opts

    plain_world = dataclasses.replace(world, activation_checkpointing=False, shadows={}, skeletons={})
    a1, c1, o1 = update(plain_world)
    a2, c2, _ = update(dataclasses.replace(plain_world, defer_grad_sync=True, shadows={}, skeletons={}))
    a4, c4, _ = update(dataclasses.replace(world, shadows={}, skeletons={}))  # activation checkpointing on
    full = [world.full_state_dict(x) for x in (a1, c1, a2, c2, a4, c4)]
    if world.is_main:
        result["deferred_vs_every_micro_batch"] = max(max_abs_diff(full[0], full[2]), max_abs_diff(full[1], full[3]))
        result["checkpointed_vs_not"] = max(max_abs_diff(full[0], full[4]), max_abs_diff(full[1], full[5]))
        result["update_moved"] = max_abs_diff(full[0], {k: v for k, v in base_actor.state_dict().items() if k in full[0]})

    # -- a sharded optimizer checkpoint, resumed ------------------------------------------------------
    stage = out.parent / "stage"
    named = {"actor": (a1, o1.actor), "critic": (c1, o1.critic)}
    world.save_optimizers(stage, named)
    if world.is_main:
        result["optimizer_files"] = sorted(p.name for p in (stage / distributed.OPTIMIZER_DIR).iterdir())
        result["optimizer_pt"] = float((stage / distributed.OPTIMIZER_FILE).exists())
    gathered = world.optimizer_state(a1, o1.actor)  # the full state, for the one-process read in the test
    if world.is_main:
        torch.save({"actor": gathered, "actor_weights": full[0]}, out.with_suffix(".optim.pt"))
    # a fresh pair of sharded models with a1/c1's weights and fresh optimizers, then the checkpoint
    a3 = plain_world.shard(copy.deepcopy(base_actor), keep_unsharded=False)
    c3 = plain_world.shard(copy.deepcopy(base_critic), keep_unsharded=False)
    for src, dst in ((a1, a3), (c1, c3)):
        dst.load_state_dict(src.state_dict())  # the same DTensor shards
    o3 = make_optimizers(a3, c3, cfg)
    loaded = world.load_optimizers(stage, {"actor": (a3, o3.actor), "critic": (c3, o3.critic)})
    back = world.optimizer_state(a3, o3.actor)
    if world.is_main:
        result["optimizer_loaded"] = float(loaded)
        result["optimizer_state_diff"] = max(
            float((gathered["state"][n][k].float() - back["state"][n][k].float()).abs().max())
            for n in gathered["state"] for k in ("exp_avg", "exp_avg_sq", "step"))
    # the next update from both: identical
    rng = random.Random(1)
    more = [synthetic_episode(rng, rng.randint(1, 3)) for _ in range(4)]
    for a, c, o in ((a1, c1, o1), (a3, c3, o3)):
        b = prepare_batch(a, c, more, [0.5] * 4, cfg, world=plain_world)
        ppo_update(a, c, b, cfg, o, seed=7, world=plain_world)
    after = [world.full_state_dict(x) for x in (a1, c1, a3, c3)]
    if world.is_main:
        result["resumed_update_diff"] = max(max_abs_diff(after[0], after[2]), max_abs_diff(after[1], after[3]))
        result["resumed_update_moved"] = max_abs_diff(after[0], full[0])
        out.write_text(json.dumps(result, indent=1))
    distributed.shutdown()
    distributed.exit_rank(0)


if __name__ == "__main__":
    main()
