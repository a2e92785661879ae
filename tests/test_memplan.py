"""The planner's numbers against hand-computed cases, and the scale/ files it plans for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from minirsi.config import load_config
from minirsi.run.memplan import GIB, KNOWN_SHAPES, ModelShape, Passes, ScaleConfig, passes_of, plan, shape_of

ROOT = Path(__file__).parents[1]
# h=4, L=2, V=10, I=8, 2 heads of 2 (q=4), 1 kv head (kv=2), untied head.
TOY = ModelShape(hidden=4, layers=2, vocab=10, intermediate=8, heads=2, kv_heads=1, head_dim=2, tied=False)


def test_parameter_counts_by_hand():
    # P_l = q 4*4 + k,v 2*4*2 + o 4*4 + q/k norms 2*2 + two RMSNorms 2*4 + MLP 3*4*8 = 16+16+16+4+8+96
    assert TOY.layer_params == 156
    assert TOY.actor_params == 2 * 156 + 2 * 40 + 4  # layers, embedding + untied head, final norm
    assert TOY.critic_params == 2 * 156 + 40 + 4 + 4 + 1  # no LM head; value head h + 1
    assert TOY.act_elems() == 4 * 4 + 2 * 4 + 2 * 2 + 4 * 8  # 60


def test_memory_by_hand():
    scale = ScaleConfig(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, micro_batch=1,
                        activation_checkpointing=False, tokens_per_step=6, peak_tflops=1e-9, mfu=0.5)
    p = plan(TOY, scale)
    # actor (untied: root = embedding 40 + final norm 4 in bf16, head 40 in fp32): states 16*396/2;
    # gathered 2*2*156 (two bf16 layers) + 2*44 (root) + 4*40 (fp32 head) = 872, plus the largest
    # unit's gradient and reduce-scatter input: max(layer (2+4)*156 = 936, root 6*44, head 8*40) = 936;
    # activations 2 bytes*3 tokens*2 layers*60; logits of the update 24 bytes*3 tokens*10
    assert (p.actor.states, p.actor.gathered, p.actor.activations, p.actor.logits) == (3168, 1808, 720, 720)
    # critic: 16*361/2; 624 + 2*44 + 4*5 (value head h+1 in fp32) + 936; same activations; no logits
    assert (p.critic.states, p.critic.gathered, p.critic.activations, p.critic.logits) == (2888, 1668, 720, 0)
    resident = 3168 + 2888
    assert p.by_pass == {
        # the two models in turn: max(1808 + 720 + 720, 1668 + 720)
        "RPR update micro-batch": resident + 3248,
        # one sequence of 3 tokens: a layer's tensors + the residual stream 2*3*(4 + 60) = 384,
        # the actor's logits 12*3*10 = 360
        "RPR no-grad scoring pass": resident + max(1808 + 384 + 360, 1668 + 384),
        "RSR SFT step": 3168 + 1808 + 720 + 12 * 3 * 10,
        "critic warm-up update": 2888 + 1668 + 720,
        "critic warm-up values": 2888 + 1668 + 384,
    }
    assert p.total == resident + 3248 == 9304
    # fits: 9304 bytes <= 1 GiB * 0.9 - 0.5 GiB; the margin left is 0.5 GiB - 9304 bytes
    assert p.fits and p.margin_left == 0.5 * GIB - 9304


def test_flops_and_communication_by_hand():
    scale = ScaleConfig(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, micro_batch=1,
                        activation_checkpointing=False, tokens_per_step=6, peak_tflops=1e-9, mfu=0.5,
                        net_gbps=8e-9)  # 1 byte per second
    p = plan(TOY, scale)
    # forward per token: actor 2*(396-40) + 2*2 layers*4*3 = 760; critic 2*(361-40) + 48 = 690;
    # 1 no-grad pass + 1 epoch x 3 = 4 passes over 6 tokens -> 6*1450*4 FLOPs at 2 GPUs x 1000 FLOP/s x 0.5
    assert p.flops == 34800
    assert p.step_seconds == pytest.approx(34.8)
    # 6 tokens / (2 GPUs x 3) = 1 micro-batch per GPU: per model, bf16 gathers for forward and
    # backward 2*2*P, an fp32 reduce-scatter 4*P, and one gather 2*P for its no-grad pass;
    # a ring collective moves (G-1)/G = 1/2 of that per GPU
    assert p.comm_seconds == pytest.approx((8 * 396 + 2 * 396 + 8 * 361 + 2 * 361) / 2)


def test_chunked_logits_by_hand():
    base = dict(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, activation_checkpointing=False, tokens_per_step=6)
    p = plan(TOY, ScaleConfig(**base), passes=Passes(logit_chunk=2, sft_logit_chunk=2))
    # update: 16 bytes * 2 positions * 10 + the fp32 hidden states and their gradient 8*3 tokens*4
    assert p.actor.logits == 16 * 2 * 10 + 8 * 3 * 4 == 416
    assert p.by_pass["RSR SFT step"] == 3168 + 1808 + 720 + (12 * 2 * 10 + 8 * 3 * 4)
    # scoring: 8 bytes * 2 * 10 + 4*3*4 (the hidden states, no gradient)
    assert p.by_pass["RPR no-grad scoring pass"] == 3168 + 2888 + 1808 + 384 + (8 * 2 * 10 + 4 * 3 * 4)
    ent = plan(TOY, ScaleConfig(**base), passes=Passes(logit_chunk=2, entropy_grad=True))
    assert ent.actor.logits == (16 + 4) * 2 * 10 + 96  # the entropy in the loss keeps its terms
    whole = plan(TOY, ScaleConfig(**base), passes=Passes(entropy_grad=True))
    assert whole.actor.logits == 24 * 3 * 10  # measured alike with or without (bench/logits.py)
    # a GPU scores at most its share of the episodes per pass: 4 episodes on 2 GPUs -> 2 rows of 3 tokens
    rows = plan(TOY, ScaleConfig(**base), passes=Passes(forward_chunk=8, episodes=4))
    assert rows.scoring_rows == 2
    assert rows.by_pass["RPR no-grad scoring pass"] == 3168 + 2888 + 1808 + 2 * 6 * 64 + 12 * 6 * 10


def test_tied_head_reduce_dtype_and_deferred_sync_by_hand():
    base = dict(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, activation_checkpointing=False, tokens_per_step=6)
    tied = ModelShape(hidden=4, layers=2, vocab=10, intermediate=8, heads=2, kv_heads=1, head_dim=2, tied=True)
    p = plan(tied, ScaleConfig(**base))
    # tied: the root unit (embedding = head, final norm: 44) is fp32: 624 + 4*44, grads max(936, 4*44)
    assert p.actor.gathered == 624 + 176 + 936
    bf = plan(TOY, ScaleConfig(**base, reduce_dtype="bfloat16"))
    assert bf.actor.gathered == 872 + max((2 + 2) * 156, 4 * 44, 8 * 40)  # 624: bf16 reduce-scatter input
    d = plan(TOY, ScaleConfig(**base, defer_grad_sync=True))
    assert d.deferred == 4 * 396 + 4 * 361  # every unit's unsharded fp32 gradient, both models
    assert d.by_pass["RPR update micro-batch"] == plan(TOY, ScaleConfig(**base)).by_pass["RPR update micro-batch"] + d.deferred


def test_checkpointing_lora_and_reference_by_hand():
    base = dict(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, tokens_per_step=6)
    p = plan(TOY, ScaleConfig(**base, activation_checkpointing=True))
    assert p.actor.activations == 2 * 3 * (2 * 4 + 60)  # layer inputs + one layer recomputed
    assert p.activations_no_ckpt == 1440 and p.activations_ckpt == 2 * 408
    assert p.flops == 6 * 1450 * 5  # recompute: a 5th forward
    lora = plan(TOY, ScaleConfig(**base, lora=True, kl_reference=True))
    assert lora.actor.states == 4 * 396 / 2  # the frozen base's fp32 shards only
    assert lora.actor.gathered == 872  # no unsharded gradients of the base
    assert lora.reference == 0  # the reference is the adapter-disabled actor
    ref = plan(TOY, ScaleConfig(**base, kl_reference=True))
    assert ref.reference == 4 * 396 / 2  # fp32 shards, as loaded
    assert ref.flops == 6 * 1450 * 5 + 6 * 760


def test_margin_is_kept():
    # a GPU with 5% more than the plan needs fits without a margin, not with the 10% default
    need = plan(TOY, ScaleConfig(gpus=2, gpu_mem_gib=1, reserve_gib=0, seq_len=3, activation_checkpointing=False,
                                 tokens_per_step=6)).total
    for margin, fits in ((0.0, True), (0.1, False)):
        scale = ScaleConfig(gpus=2, gpu_mem_gib=need / GIB / 0.95, reserve_gib=0, margin=margin, seq_len=3,
                            activation_checkpointing=False, tokens_per_step=6)
        assert plan(TOY, scale).fits is fits


def test_fit_flips_with_memory():
    scale = ScaleConfig(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, tokens_per_step=6)
    assert plan(TOY, scale).fits
    tiny_gpu = ScaleConfig(gpus=2, gpu_mem_gib=6000 / GIB, reserve_gib=0, seq_len=3, tokens_per_step=6)
    assert not plan(TOY, tiny_gpu).fits


def test_qwen3_32b_shape_matches_its_published_size():
    shape = KNOWN_SHAPES["Qwen/Qwen3-32B"]
    assert shape.actor_params / 1e9 == pytest.approx(32.8, rel=0.01)  # the model card's 32.8B
    assert KNOWN_SHAPES["Qwen/Qwen3-8B"].actor_params / 1e9 == pytest.approx(8.2, rel=0.01)
    assert KNOWN_SHAPES["Qwen/Qwen3-0.6B"].actor_params / 1e9 == pytest.approx(0.6, rel=0.05)


def test_shape_from_a_transformers_config(tmp_path):
    from tiny import tiny_qwen

    model = tiny_qwen()
    shape = ModelShape.from_config(model.config)
    assert shape.actor_params == sum(p.numel() for p in model.parameters())
    model.config.to_json_file(tmp_path / "config.json")
    assert shape_of(str(tmp_path)) == shape


@pytest.mark.parametrize("config", sorted((ROOT / "scale/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_scale_configs_load_and_fit(config):
    from minirsi.run.config import RunConfig

    cfg = load_config(RunConfig, config)
    assert cfg.base.model in KNOWN_SHAPES and cfg.device == "cuda"
    p = plan(KNOWN_SHAPES[cfg.base.model], cfg.scale, passes=passes_of(cfg))
    assert p.fits, p.table()
    assert p.margin_left >= 0.10 * cfg.scale.gpu_mem_gib * GIB, p.table()  # >= 10% of HBM free, every pass planned
    assert passes_of(cfg) == passes_of(yaml.safe_load(config.read_text()))  # the CLI reads the YAML alike
    assert cfg.rpr1.forward_chunk == 1 and cfg.rpr1.logit_chunk > 0 and cfg.rsr1.logit_chunk > 0
    # micro_batch is what the RPR config gives each GPU
    assert cfg.rpr1.minibatch_size // cfg.rpr1.grad_accum // cfg.scale.gpus == cfg.scale.micro_batch
    proc = subprocess.run([sys.executable, "-m", "minirsi.cli", "plan", "--config", str(config)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "FITS" in proc.stdout, proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "scale/accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_yamls_hold_only_what_minirsi_reads(path):
    """Every fsdp_config key is one accelerate turns into a variable minirsi reads (or its
    version); the activation checkpointing agrees with the run config the file is for."""
    from minirsi.run.config import RunConfig

    data = yaml.safe_load(path.read_text())
    fsdp = data["fsdp_config"]
    assert data["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
    assert set(fsdp) == {"fsdp_version", "fsdp_reshard_after_forward", "fsdp_activation_checkpointing"}
    assert data["mixed_precision"] == "no"  # minirsi's own policy: bf16 layers, fp32 heads
    assert data["num_processes"] == 8 * data["num_machines"]
    run = load_config(RunConfig, ROOT / "scale/configs" / ("qwen3-8b-1x8.yaml" if data["num_machines"] == 1
                                                           else "qwen3-32b-4x8.yaml"))
    assert fsdp["fsdp_activation_checkpointing"] is run.scale.activation_checkpointing
    # accelerate's own reader accepts it (the class `accelerate launch` builds from the file)
    from accelerate.commands.config.config_args import ClusterConfig

    assert ClusterConfig.from_yaml_file(str(path)).fsdp_config["fsdp_version"] == 2


def test_plan_cli_refuses_a_config_that_does_not_fit():
    proc = subprocess.run([sys.executable, "-m", "minirsi.cli", "plan", "--model", "Qwen/Qwen3-32B", "--gpus", "8",
                           "--gpu-mem-gib", "80", "--seq-len", "8192"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout


def test_run_refuses_a_config_the_planner_says_will_not_fit(tmp_path, capsys):
    from minirsi.run import recipe
    from tiny import tiny_qwen

    model_dir = tmp_path / "model"
    tiny_qwen().config.save_pretrained(model_dir)  # the shape is all the planner reads
    out = tmp_path / "run"
    # 4096 tokens x 300 vocabulary x 14 bytes of logits alone are 16 MiB > 10 MiB
    rc = recipe.cli(["--preset", "smoke", "--out", str(out), f"base.model={model_dir}", "scale.gpus=1",
                       "scale.gpu_mem_gib=0.01", "scale.reserve_gib=0", "scale.seq_len=4096"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit" in err and "Fix:" in err
    assert not out.exists()  # refused before anything was written
    ok = recipe.check_plan(load_config(recipe.RunConfig, recipe.resolve_preset("smoke"),
                                       [f"base.model={model_dir}", "scale.gpus=1", "scale.gpu_mem_gib=1",
                                        "scale.reserve_gib=0", "scale.seq_len=64"]))
    assert ok.fits


def test_gpu_check_script_runs_to_its_cuda_check():
    """scale/gpu_check.py imports everything it uses; without CUDA it says so and exits 1."""
    proc = subprocess.run([sys.executable, "scale/gpu_check.py"], capture_output=True, text=True, cwd=ROOT)
    if torch_cuda():
        pytest.skip("a GPU is present: run the script itself (scale/README.md)")
    assert proc.returncode == 1 and "no CUDA device" in proc.stderr, proc.stderr[-2000:]


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
