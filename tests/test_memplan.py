"""The planner's numbers against hand-computed cases, and the scale/ files it plans for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from minirsi.config import load_config
from minirsi.memplan import GIB, KNOWN_SHAPES, ModelShape, ScaleConfig, plan, shape_of

ROOT = Path(__file__).parents[1]
# h=4, L=2, V=10, I=8, 2 heads of 2 (q=4), 1 kv head (kv=2), untied head.
TOY = ModelShape(hidden=4, layers=2, vocab=10, intermediate=8, heads=2, kv_heads=1, head_dim=2, tied=False)


def test_parameter_counts_by_hand():
    # P_l = q 4*4 + k,v 2*4*2 + o 4*4 + q/k norms 2*2 + two RMSNorms 2*4 + MLP 3*4*8 = 16+16+16+4+8+96
    assert TOY.layer_params == 156
    assert TOY.actor_params == 2 * 156 + 2 * 40 + 4  # layers, embedding + untied head, final norm
    assert TOY.critic_params == 2 * 156 + 40 + 4 + 4 + 1  # no LM head; value head h + 1
    assert TOY.act_elems() == 4 * 4 + 2 * 4 + 2 * 2 + 4 * 8  # 60


def test_memory_and_flops_by_hand():
    scale = ScaleConfig(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, micro_batch=1,
                        activation_checkpointing=False, tokens_per_step=6, peak_tflops=1e-9, mfu=0.5)
    p = plan(TOY, scale)
    # actor: states 16*396/2; gathered 2*(2*156 + root 84) + 4*156; activations 2 bytes*3 tokens*2 layers*60;
    # logits 14 bytes*3 tokens*10
    assert (p.actor.states, p.actor.gathered, p.actor.activations, p.actor.logits) == (3168, 1416, 720, 420)
    assert p.actor.total == 5724
    # critic: 16*361/2; 2*(312 + 49) + 624; same activations; no logits
    assert (p.critic.states, p.critic.gathered, p.critic.activations, p.critic.logits) == (2888, 1346, 720, 0)
    assert p.total == 5724 + 4954 and p.fits
    # forward per token: actor 2*(396-40) + 2*2 layers*4*3 = 760; critic 2*(361-40) + 48 = 690;
    # 1 no-grad pass + 1 epoch x 3 = 4 passes over 6 tokens -> 6*1450*4 FLOPs at 2 GPUs x 1000 FLOP/s x 0.5
    assert p.flops == 34800
    assert p.step_seconds == pytest.approx(34.8)


def test_checkpointing_lora_and_reference_by_hand():
    base = dict(gpus=2, gpu_mem_gib=1, reserve_gib=0.5, seq_len=3, tokens_per_step=6)
    p = plan(TOY, ScaleConfig(**base, activation_checkpointing=True))
    assert p.actor.activations == 2 * 3 * (2 * 4 + 60)  # layer inputs + one layer recomputed
    assert p.activations_no_ckpt == 1440 and p.activations_ckpt == 2 * 408
    assert p.flops == 6 * 1450 * 5  # recompute: a 5th forward
    lora = plan(TOY, ScaleConfig(**base, lora=True, kl_reference=True))
    assert lora.actor.states == 2 * 396 / 2  # frozen bf16 base only
    assert lora.actor.gathered == 2 * (2 * 156 + 84)  # no fp32 unsharded grads of the base
    assert lora.reference == 0  # the reference is the adapter-disabled actor
    ref = plan(TOY, ScaleConfig(**base, kl_reference=True))
    assert ref.reference == 2 * 396 / 2
    assert ref.flops == 6 * 1450 * 5 + 6 * 760


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
    from minirsi.recipe import RunConfig

    cfg = load_config(RunConfig, config)
    assert cfg.base.model in KNOWN_SHAPES and cfg.device == "cuda"
    p = plan(KNOWN_SHAPES[cfg.base.model], cfg.scale)
    assert p.fits, p.table()
    # micro_batch is what the RPR config gives each GPU
    assert cfg.rpr1.minibatch_size // cfg.rpr1.grad_accum // cfg.scale.gpus == cfg.scale.micro_batch
    proc = subprocess.run([sys.executable, "-m", "minirsi.cli", "plan", "--config", str(config)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "FITS" in proc.stdout, proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "scale/accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_yamls_parse(path):
    data = yaml.safe_load(path.read_text())
    fsdp = data["fsdp_config"]
    assert data["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
    assert data["mixed_precision"] == "bf16" and fsdp["fsdp_activation_checkpointing"] is True
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3DecoderLayer"
    assert data["num_processes"] == 8 * data["num_machines"]
    # accelerate's own reader accepts it (the class `accelerate launch` builds from the file)
    from accelerate.commands.config.config_args import ClusterConfig

    assert ClusterConfig.from_yaml_file(str(path)).fsdp_config["fsdp_version"] == 2


def test_slurm_script_parses():
    script = ROOT / "scale/slurm/train-4x8.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    directives = dict((line[len("#SBATCH --"):].split("=", 1) + [""])[:2] for line in script.read_text().splitlines()
                      if line.startswith("#SBATCH --"))
    assert directives["nodes"] == "4" and directives["gpus-per-node"] == "8"
    text = script.read_text()
    assert "scale/configs/qwen3-32b-4x8.yaml" in text and "minirsi run" in text and "minirsi.cli plan" in text


def test_plan_cli_refuses_a_config_that_does_not_fit():
    proc = subprocess.run([sys.executable, "-m", "minirsi.cli", "plan", "--model", "Qwen/Qwen3-32B", "--gpus", "8",
                           "--gpu-mem-gib", "80", "--seq-len", "8192"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout


def test_run_refuses_a_config_the_planner_says_will_not_fit(tmp_path, capsys):
    from minirsi import recipe
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
