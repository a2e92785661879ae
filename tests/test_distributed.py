"""FSDP2 data parallelism (minirsi/core/distributed.py): 2 gloo processes on the CPU give the
one-process update, the world-size-1 hooks are the identity, and checkpoints reload anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minirsi.core import distributed
from minirsi.core.distributed import SINGLE, World, max_abs_diff
from test_serving import procs  # noqa: F401  (a fixture: `minirsi serve` processes)

ROOT = Path(__file__).parents[1]
TOL = 1e-5


def torchrun(*args: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc ARGS`` from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def minirsi_run(args: list[str], nproc: int, timeout: int = 800) -> subprocess.CompletedProcess:
    """``minirsi ARGS`` in one process, or under torchrun with ``nproc`` ranks."""
    if nproc > 1:
        return torchrun("--no-python", "minirsi", *args, nproc=nproc, timeout=timeout)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minirsi.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_world_size_one_hooks_are_the_identity():
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "attention_mask": torch.ones(3, 4),
             "action_mask": torch.ones(3, 4)}
    assert SINGLE.local(batch) is batch
    n = torch.tensor(7.0)
    assert SINGLE.normalizer(n) is n
    assert SINGLE.all_sum([1.5, 2.0]) == [1.5, 2.0]
    model = torch.nn.Linear(2, 2)
    assert SINGLE.shard(model) is model and SINGLE.unsharded(model) is model
    assert SINGLE.broadcast({"a": 1}) == {"a": 1}


def test_init_without_a_launcher_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.init() is SINGLE and distributed.current() is SINGLE


def test_local_rows_and_stand_in_row():
    # rank 1 of 2 on a 3-row batch takes row 1; on a 1-row batch it gets row 0 with no action token
    w = World(rank=1, size=2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    batch = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": mask, "action_mask": mask.float()}
    mine = w.local(batch)
    assert mine["input_ids"].tolist() == [[4, 5]]  # row 1, cut after its 2 tokens
    one = w.local({k: v[:1] for k, v in batch.items()})
    assert one["input_ids"].shape == (1, 3) and one["action_mask"].sum() == 0


def test_max_abs_diff_names_missing_keys():
    with pytest.raises(ValueError, match="keys"):
        max_abs_diff({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_process_updates_equal_one_process(tmp_path, lora):
    """PPO update (2 epochs, grad accumulation, a stand-in row), RSR SFT step and critic warm-up
    update: FSDP2 over 2 ranks vs one process on the same episodes (LoRA: with a KL term against
    the adapter-free reference)."""
    out = tmp_path / "eq.json"
    proc = torchrun("tests/dist_equal.py", str(out), *(["--lora"] if lora else []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2
    for key in ("ppo_actor", "ppo_critic", "sft_actor", "warmup_critic", "ppo_old_logprobs", "ppo_old_values"):
        assert r[key] <= TOL, (key, r[key])
    assert r["optimizer_reload"] == 0.0  # a one-process AdamW state, sharded and gathered back
    assert r["ppo_metrics"] <= 1e-5 and r["sft_loss"] <= 1e-5 and r["warmup_ev"] <= 1e-4  # EV of the 2nd epoch: from weights equal to ~1e-6
    # the update really moved the weights, by far more than the two runs differ
    assert r["ppo_actor_moved"] > 100 * max(r["ppo_actor"], 1e-7)
    if not lora:
        assert r["reload_2proc"] == 0.0  # saved from 2 ranks, loaded and re-sharded on 2 ranks
        from transformers import AutoModelForCausalLM

        saved = torch.load(out.with_suffix(".state.pt"))
        one = AutoModelForCausalLM.from_pretrained(out.with_suffix(".ckpt")).state_dict()
        assert max_abs_diff(saved, {k: v for k, v in one.items() if k in saved}) == 0.0  # 1 process


@pytest.mark.slow
def test_scale_path_on_two_ranks(tmp_path):
    """tests/dist_scale.py on 2 gloo ranks: activation checkpointing from the run config under
    torchrun, fp32 heads over bf16 layers, deferred gradient sync, a sharded optimizer
    checkpoint resumed identically; then the checkpoint read back in one process."""
    out = tmp_path / "scale.json"
    proc = torchrun("tests/dist_scale.py", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2
    # torchrun sets no FSDP variable: the config turned checkpointing on, on every decoder layer
    assert r["ckpt_from_config"] == 1.0 and r["wrapped_layers"] == 2
    assert r["checkpointed_vs_not"] <= TOL  # a PPO update with the layers recomputed in backward: the same
    assert r["conflict_refused"] == 1.0 and "scale.activation_checkpointing=true" in r["conflict_message"]
    for name in ("untied", "tied", "critic"):  # fp32 weights in, fp32 logits (values) out, bf16 layers
        h = r[f"heads_{name}"]
        assert h["layer"] == "torch.bfloat16", name
        assert (h["head0"]["weight"], h["head0"]["input"], h["head0"]["output"]) == ("torch.float32",) * 3, name
        assert h["head0"]["fp32_matmul"] == 0.0, name
    # deferred sync: nothing reduced after the first micro-batch, every gradient after the last
    assert r["grads_after_first_micro_batch"] == 0.0 and r["grads_after_last_micro_batch"] > 0
    assert r["deferred_vs_every_micro_batch"] <= TOL and r["update_moved"] > 100 * TOL
    # the optimizer: one shard file per rank (nothing gathered), resumed bit for bit
    assert r["optimizer_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"] and r["optimizer_pt"] == 0.0
    assert r["optimizer_loaded"] == 1.0 and r["optimizer_state_diff"] == 0.0
    assert r["resumed_update_diff"] == 0.0 and r["resumed_update_moved"] > 1e-4
    # one process reads the sharded checkpoint (DCP reshards): the gathered state, by name
    from minirsi.core.rpr import RPRConfig, make_optimizers
    from tiny import tiny_qwen

    saved = torch.load(out.with_suffix(".optim.pt"), weights_only=False)
    actor = tiny_qwen(seed=1)
    actor.load_state_dict(saved["actor_weights"], strict=False)
    opt = make_optimizers(actor, torch.nn.Linear(1, 1), RPRConfig()).actor
    assert SINGLE.load_optimizers(tmp_path / "stage", {"actor": (actor, opt)})
    names = [n for n, p in actor.named_parameters() if p.requires_grad]
    one = opt.state_dict()["state"]
    want = saved["actor"]["state"]
    assert max(float((one[i][k] - want[n][k]).abs().max()) for i, n in enumerate(names)
               for k in ("exp_avg", "exp_avg_sq", "step")) == 0.0


@pytest.mark.slow
def test_warmup_and_evaluation_are_sharded_on_two_ranks(tmp_path):
    """tests/dist_stages.py: the warm-up and the evaluation on 2 gloo ranks load the actor and
    the critic sharded (no rank loads a whole model with the one-process loader; the critic
    trains as 1/2 shards), sample on rank 0 only: from its unsharded host copy without servers,
    on the servers with them (after a push of the gathered weights), and keep no copy after."""
    root = _checkpoints(tmp_path / "ckpt")
    out = tmp_path / "stages.json"
    proc = torchrun("tests/dist_stages.py", str(root), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["one_process_loads"] == 0
    assert r["shares"]["warmup_critic"] == [0.5, 0.5]  # every rank holds half of the critic it trains
    # every rank holds half of the actor in the warm-up and the evaluation, with and without
    # servers (4 loads a rank); without servers rank 0's whole copy is a separate host module
    assert sorted((a["rank"], a["share"]) for a in r["actor_shares"]) == [(0, 0.5)] * 4 + [(1, 0.5)] * 4
    in_process, served = r["collect"][:2], r["collect"][2:]  # warm-up then evaluation, per setting
    assert all(c["rank"] == 0 and c["sampler"] == "HFSampler" and c["model_share"] == 1.0 for c in in_process)
    assert all(c["rank"] == 0 and c["sampler"] == "SimpleNamespace" and c["model_share"] is None for c in served)
    assert [p["rank"] for p in r["pushed"]] == [0, 0] and all(p["model_share"] == 1.0 for p in r["pushed"])
    assert r["eval_0"] == r["eval_1"] == 4
    for k in ("warmup_kept_0", "eval_kept_0", "warmup_kept_1", "eval_kept_1"):
        assert r[k] == 0.0, k  # the stage's copies and skeletons are released at its end


def _checkpoints(root: Path) -> Path:
    """A saved tiny actor (with a ChatML tokenizer) and a saved critic with a non-zero head."""
    from minirsi.core.critic import build_critic, save_critic
    from minirsi.engine.models import build_tokenizer, save_actor
    from tiny import tiny_qwen

    tok = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    actor = tiny_qwen(vocab=300, seed=0)
    save_actor(actor, tok, root / "actor")
    save_critic(build_critic(actor, head_init_std=0.1), root / "critic")
    return root


def test_world_size_one_loads_as_before(tmp_path):
    """At world size 1, load_sharded is load() (build() is never called) and load_actor_sharded
    is load_actor: the same weights, the same module types."""
    from minirsi.core.critic import fingerprint, load_critic, load_critic_sharded
    from minirsi.engine.models import load_actor, load_actor_sharded

    root = _checkpoints(tmp_path)
    model = torch.nn.Linear(2, 2)
    assert SINGLE.load_sharded(lambda: model, lambda: pytest.fail("build() called at world size 1")) is model
    a, _ = load_actor(root / "actor")
    b, _ = load_actor_sharded(root / "actor", SINGLE)
    assert type(a) is type(b) and fingerprint(a) == fingerprint(b) and b.training == a.training
    assert fingerprint(load_critic_sharded(root / "critic", SINGLE)) == fingerprint(load_critic(root / "critic"))


def test_meta_copy_holds_no_weights_and_filled_restores_them():
    """The skeleton rank 0 keeps instead of an unsharded copy: meta parameters, real buffers
    (RoPE's inv_freq), ties kept; filled() puts a state dict back without copying it."""
    from minirsi.core.distributed import filled, meta_copy
    from tiny import tiny_qwen

    model = tiny_qwen(seed=0)
    skeleton = meta_copy(model)
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    assert torch.equal(skeleton.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as a tied gather may
    plain = filled(skeleton, state)
    assert plain.model.embed_tokens.weight.data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # no copy
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    assert all(p.is_meta for p in skeleton.parameters())  # the skeleton is reused for the next push
    only_head = {k: v for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    tied = filled(skeleton, only_head)  # either name of a tied pair fills both
    assert tied.model.embed_tokens.weight is tied.lm_head.weight
    del state["model.norm.weight"]
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        filled(skeleton, state)


@pytest.mark.slow
def test_load_sharded_equals_from_pretrained(tmp_path):
    """Rank 0 loads, rank 1 builds on the meta device, the weights are broadcast to the shards:
    gathered, every parameter equals a one-process from_pretrained bit for bit and every rank's
    buffers (RoPE's inv_freq: in no state dict) equal too, for the actor (plain, LoRA, frozen as
    the KL reference, with activation checkpointing) and for the critic (saved, or built from the actor's checkpoint);
    a PPO update after it equals the update after the every-rank load; and an actor sharded
    with no unsharded copy (servers sample) is gathered whole for a push and a save."""
    root = _checkpoints(tmp_path / "ckpt")
    out = tmp_path / "load.json"
    proc = torchrun("tests/dist_load.py", str(root), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2
    for key in ("actor", "lora", "reference", "checkpointed", "critic", "built_critic"):
        assert r[f"{key}_state"] == 0.0, key
    assert r["reference_not_frozen"] == 0.0
    for key in ("actor", "checkpointed", "critic", "built_critic"):
        assert r[f"{key}_buffers"] == 0.0, key
    assert r["actor_training"] == r["critic_training"] == r["built_critic_training"] == 0.0  # eval/train as loaded
    assert r["lora_trainable_not_lora"] == 0.0
    assert r["ppo_actor"] <= TOL and r["ppo_critic"] <= TOL and r["ppo_moved"] > 1e-4
    assert r["rank0_keeps_copy"] == 1.0 and r["served_keeps_copy"] == 0.0  # rank 0 only / nobody
    assert r["rollout_gets_sharded"] == 2.0  # gather=False: rank 0's sampler got the sharded actor, no gather
    assert r["push_state"] == 0.0 and r["push_logits"] == 0.0 and r["push_tied"] == 1.0 and r["push_frozen"] == 1.0
    assert r["served_save"] == 0.0
    assert r["failure_raised"] == 2.0 and "has no config.json" in r["failure_message"]
    assert r["mismatch_raised"] == 2.0 and "torch.float64" in r["mismatch_message"]


# ------------------------------------------------------------------------- the recipe under torchrun

# Every RPR group trains: with 4 tasks and 2 turns most groups are uniform, and dropped groups
# would leave an RPR step with nothing to update (and nothing to push).
EVERY_GROUP_TRAINS = ["rpr1.drop_uniform_groups=false", "rpr2.drop_uniform_groups=false", "rpr1.oversample=1",
                      "rpr2.oversample=1"]

# The smoke preset, cut to seconds a stage: 4 training tasks, one RPR step per phase, 2 turns.
# The Base is the shipped one (minirsi/presets/toy-base: smoke's pretrain config), so nothing pretrains.
CI_OVERRIDES = ["suites.train=4", "suites.core=4", "rsr1.samples_per_task=1", "rsr2.samples_per_task=1",
                "rsr1.epochs=1", "rsr2.epochs=1", "rpr1.steps=1", "rpr2.steps=1", "rpr1.critic_calibration_updates=1",
                "rpr2.critic_calibration_updates=0", "rpr1.episodes_per_step=4", "rpr2.episodes_per_step=4",
                "rpr1.minibatch_size=4", "rpr2.minibatch_size=4", "rpr1.ppo_epochs=1", "rpr2.ppo_epochs=1",
                "eval.k=1", "rollout.max_turns=2", "eval.rollout.max_turns=2", *EVERY_GROUP_TRAINS]


def _check_run(run_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    from minirsi.core.critic import load_critic
    from minirsi.engine.models import load_actor

    results = json.loads((run_dir / "results.json").read_text())
    assert set(results) == {"base", "rpr2"}
    assert 0.0 <= results["rpr2"]["core"]["mean_at_1"] <= 1.0 and results["rpr2"]["core"]["n_tasks"] == 4
    stages = sorted((run_dir / "stages").iterdir())
    assert [d.name for d in stages] == ["00-base", "01-rsr1", "02-warmup", "03-rpr1", "04-rsr2", "05-rpr2", *extra]
    assert all((d / "DONE.json").is_file() for d in stages)
    load_actor(run_dir / "stages/05-rpr2/actor")  # gathered save_pretrained dirs: one process reads them
    load_critic(run_dir / "stages/05-rpr2/critic")  # (checks the critic's fingerprint)
    assert {"optimizer.pt", "optimizer"} & {p.name for p in (run_dir / "stages/03-rpr1").iterdir()}
    return results


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_two_processes_run_the_smoke_recipe(tmp_path):
    out = tmp_path / "run"
    # with Direct PPO and a continuation of RPR-1 (it loads RPR-1's gathered optimizer state);
    # RPR-1 draws at the edge of competence as toy-cpu does (every rank sees the same episodes)
    proc = minirsi_run(["run", "--preset", "smoke", "--out", str(out), "--no-report", *CI_OVERRIDES,
                        "baselines.direct_ppo=true", "baselines.continue_rpr1=1", "rpr1.pool_sampling=edge"], 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_run(out, ("06-direct_ppo", "07-rpr1_cont"))
    assert proc.stdout.count("run dir:") == 1  # rank 0 alone reports
    # the smoke preset's scale section turns activation checkpointing on under torchrun
    assert "FSDP2 over 2 ranks (gloo, cpu), activation checkpointing on" in proc.stderr
    # optimizer states: sharded checkpoints (one file per rank), none gathered to rank 0
    for stage in ("01-rsr1", "02-warmup", "03-rpr1", "07-rpr1_cont"):
        files = sorted(p.name for p in (out / "stages" / stage / "optimizer").iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], (stage, files)
        assert not (out / "stages" / stage / "optimizer.pt").exists()


def _descendants(pid: int) -> list[int]:
    """The live descendants of `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie is reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("resume_nproc", [1, 2])
def test_kill_a_two_process_run_then_resume(tmp_path, resume_nproc):
    import signal
    import threading
    import time

    from minirsi.run.runlock import RunDirBusy, RunLock

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python",
           "minirsi", "run", "--preset", "smoke", "--out", str(out), "--no-report", *CI_OVERRIDES]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)
    warm = threading.Event()

    def watch() -> None:  # event-driven: the run's own log line, read as it is written (no polling)
        for line in job.stderr:  # drained to the end, so no rank ever blocks on a full pipe
            if b"stage 02-warmup done" in line:  # rundir._train_stage logs it after writing DONE.json
                warm.set()
        warm.set()  # the run ended (or was killed) without it: the assertion below says so

    threading.Thread(target=watch, daemon=True).start()
    try:
        warm.wait(800)
        assert (out / "stages/02-warmup/DONE.json").exists(), "the 2-process run never finished the warm-up"
        with pytest.raises(RunDirBusy) as busy:  # the live 2-process run holds the directory
            RunLock.acquire(out)
        ranks = _descendants(job.pid)  # torchrun starts each rank in a session of its own
        assert len(ranks) >= 2, ranks
        holder = busy.value.holder["pid"]
        assert holder in ranks and f"pid {holder} " in str(busy.value)  # rank 0 holds it for its launch
        os.killpg(job.pid, signal.SIGKILL)  # the launcher, mid-run: the ranks must follow it
        job.wait(30)
        deadline = time.time() + 30
        while any(_alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in ranks if _alive(pid)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        assert not survivors, f"ranks outlived their launcher by 30 s: {survivors}"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    done_before = (out / "stages/01-rsr1/DONE.json").read_text()
    proc = minirsi_run(["run", "--resume", str(out), "--no-report"], resume_nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"taking over the lock of pid {holder}" in proc.stderr  # the dead rank 0's lock
    _check_run(out)
    assert (out / "stages/01-rsr1/DONE.json").read_text() == done_before  # finished stages are kept


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [1, 2])
def test_lora_recipe_option(tmp_path, nproc):
    """lora.enabled: RSR and RPR train adapters (sharded like the full model under torchrun);
    actor/ holds merged weights, adapter/ the adapter alone."""
    out = tmp_path / "run"
    proc = minirsi_run(["run", "--preset", "smoke", "--out", str(out), "--no-report", *CI_OVERRIDES,
                        "lora.enabled=true", "lora.save_adapter=true", "lora.r=4", "rpr1.kl_coef=0.05"], nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_run(out)
    adapter = out / "stages/03-rpr1/adapter"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").is_file()
    # RPR-1 trained its adapters: its merged actor differs from RSR-1's
    from minirsi.core.critic import fingerprint
    from minirsi.engine.models import load_actor

    a, _ = load_actor(out / "stages/01-rsr1/actor")
    b, _ = load_actor(out / "stages/03-rpr1/actor")
    assert fingerprint(a) != fingerprint(b)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerate_launch_two_cpu_processes(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` starts 2 gloo ranks on a CPU machine
    (``--cpu`` would start one); minirsi shards with fully_shard itself."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "--main_process_port", "0", "-m", "minirsi.cli", "run", "--preset", "smoke", "--out",
                           str(out), "--no-report", *CI_OVERRIDES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "FSDP2 over 2 ranks (gloo, cpu)" in proc.stderr
    _check_run(out)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_rpr_pushes_the_gathered_actor_to_servers(procs, tmp_path):
    """Under torchrun (2 ranks), RPR samples on two `minirsi serve` processes; after every joint
    update the sharded actor is gathered to rank 0 and pushed (tests/test_serving.py's run, sharded)."""
    from minirsi.engine.models import build_tiny_actor, build_tokenizer, load_actor, save_actor
    from minirsi.engine.weight_sync import server_prompt_logprobs
    from test_serving import TOL, _gap, _probe, _trainer_logprobs

    tok = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    save_actor(build_tiny_actor(tok, seed=0), tok, tmp_path / "base")
    a, b = procs(tmp_path / "base", 2)
    out = tmp_path / "run"
    proc = minirsi_run([
        "run", "--out", str(out), "--no-report", f"base.model={tmp_path / 'base'}",
        f"serving.servers=[{a.url},{b.url}]", "serving.verify_tol=1e-4", "serving.sync_dtype=float32",
        "suites.train=4", "suites.core=1", "suites.hard=1", "suites.long=1", "suites.unseen=1",
        "rollout.max_turns=2", "rollout.max_new_tokens=16", "rollout.command_timeout=5",
        "rsr1.samples_per_task=1", "rsr2.samples_per_task=1", "baselines.direct_ppo=false",
        "baselines.critic_reset=false", "baselines.token_gae=false", "baselines.continue_rpr1=0",
        "rpr1.steps=2", "rpr1.critic_calibration_updates=1", "rpr1.episodes_per_step=4", "rpr1.minibatch_size=4",
        "rpr2.steps=1", "rpr2.critic_calibration_updates=0", "rpr2.episodes_per_step=4", "rpr2.minibatch_size=4",
        *EVERY_GROUP_TRAINS, "eval.k=1", "eval.suites=[core]", "eval.stages=[base]", "eval.rollout.max_turns=1",
        "eval.rollout.max_new_tokens=16"], 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for stage, joint in (("rpr1", 2), ("rpr2", 1)):
        syncs = [r for r in recs if r["stage"] == stage and "sync_s" in r]
        assert len(syncs) == joint + 1 and all(r["sync_max_gap"] <= 1e-4 and r["sync_servers"] == 2 for r in syncs)
    for stage in ("rsr1", "warmup", "rsr2"):  # sharded, each stage pushes its actor and samples on the servers
        assert len([r for r in recs if r["stage"] == stage and "sync_s" in r]) == 1, stage
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["v000008", "v000009"]  # + base's evaluation
    final, _ = load_actor(out / "stages/05-rpr2/actor")
    ids = _probe(tok)
    for p in (a, b):
        assert _gap(server_prompt_logprobs(p.url, "policy", ids), _trainer_logprobs(final, ids)) <= TOL
