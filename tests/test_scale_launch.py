"""The launch scripts of scale/, run on this CPU: ``serve_vllm.sh`` against a stand-in ``vllm``
that prints what it was given, and the SLURM job ``rsi-4x8.sbatch`` with stand-ins for
``srun``/``scontrol`` (run the command here), ``minirsi serve`` for vLLM and a stand-in trainer
that checks it was handed live servers."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
JOB = ROOT / "scale/slurm/rsi-4x8.sbatch"


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free on this machine."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_serve_vllm_sh_passes_what_minirsi_needs(tmp_path):
    fake = _exe(tmp_path / "vllm", "#!/bin/bash\npython3 - \"$@\" <<'EOF'\nimport json, os, sys\n"
                "print(json.dumps({'argv': sys.argv[1:], 'PYTHONPATH': os.environ['PYTHONPATH'],"
                " 'dev': os.environ.get('VLLM_SERVER_DEV_MODE')}))\nEOF\n")
    env = {**os.environ, "VLLM": str(fake)}
    env.pop("HOST", None)
    out = subprocess.run(["bash", str(ROOT / "scale/serve_vllm.sh"), "MODEL", "8123", "--tensor-parallel-size", "4"],
                         capture_output=True, text=True, env=env, check=True).stdout
    got = json.loads(out)
    argv = got["argv"]
    pairs = dict(zip(argv[1::1], argv[2::1]))
    assert argv[:2] == ["serve", "MODEL"]
    assert pairs["--host"] == "0.0.0.0"  # reachable from the trainer's nodes
    assert pairs["--port"] == "8123" and pairs["--generation-config"] == "vllm"
    assert pairs["--logprobs-mode"] == "processed_logprobs" and pairs["--tensor-parallel-size"] == "4"
    assert pairs["--worker-extension-cls"] == "vllm_worker_ext.MinirsiWorkerExtension" and got["dev"] == "1"
    # the class resolves from the PYTHONPATH the script sets, as vLLM's resolve_obj_by_qualname imports it
    code = "import vllm_worker_ext as m; print(m.MinirsiWorkerExtension.minirsi_load_weights.__name__)"
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": got["PYTHONPATH"]}, cwd=tmp_path).stdout.strip()
    assert name == "minirsi_load_weights"
    local = subprocess.run(["bash", str(ROOT / "scale/serve_vllm.sh"), "M"], capture_output=True, text=True,
                           env={**env, "HOST": "127.0.0.1"}, check=True).stdout
    assert json.loads(local)["argv"][json.loads(local)["argv"].index("--host") + 1] == "127.0.0.1"


def test_sbatch_directives_and_syntax():
    assert subprocess.run(["bash", "-n", str(JOB)]).returncode == 0
    text = JOB.read_text()
    directives = dict((line[len("#SBATCH --"):].split("=", 1) + [""])[:2] for line in text.splitlines()
                      if line.startswith("#SBATCH --"))
    assert directives["nodes"] == "6" and directives["gpus-per-node"] == "8"  # 4 train + 2 serve
    assert "scale/configs/qwen3-32b-4x8.yaml" in text and "minirsi.cli plan" in text
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text
    assert not any(line.lstrip().startswith("export NCCL_ASYNC_ERROR_HANDLING") for line in text.splitlines())


def _job_env(tmp_path: Path, serve_script: Path, port: int, model: Path) -> dict:
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # srun: drop its options (all --key=value or flags here), run the command on this machine
    _exe(bin_ / "srun", "#!/bin/bash\nwhile [[ \"$1\" == -* ]]; do shift; done\nexec \"$@\"\n")
    _exe(bin_ / "scontrol", "#!/bin/bash\n[[ \"$1 $2\" == \"show hostnames\" ]] && tr ',' '\\n' <<< \"$3\"\n")
    trainer = _exe(tmp_path / "trainer.py", f"""#!{sys.executable}
import json, os, sys, requests
servers = next(a for a in sys.argv if a.startswith("serving.servers="))[len("serving.servers=["):-1].split(",")
health = [requests.get(s + "/health", timeout=10).status_code for s in servers]
# ignore_eos and a seed, as minirsi's client sends: a random model may sample <|im_end|> first
body = {{"model": "policy", "prompt": [[1, 2, 3]], "max_tokens": 2, "temperature": 1.0, "logprobs": 0,
        "return_token_ids": True, "ignore_eos": True, "seed": 0}}
tokens = [len(requests.post(s + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"])
          for s in servers]
json.dump({{"argv": sys.argv[1:], "servers": servers, "health": health, "tokens": tokens,
           "nccl": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}}, open({str(tmp_path / "trained.json")!r}, "w"))
""")
    return {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "SLURM_JOB_NODELIST": "trainer0,127.0.0.1", "SLURM_JOB_ID": "77", "TRAIN_NODES": "1",
            "GPUS_PER_NODE": "2", "TP": "1", "SERVE_PORT": str(port), "SERVE_SCRIPT": str(serve_script),
            "SERVE_MODEL": str(model), "SERVE_TIMEOUT": "300", "LAUNCH": "", "TRAIN": f"{sys.executable} {trainer}",
            "LOGS": str(tmp_path / "logs"), "RUN_DIR": str(tmp_path / "run")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_job_starts_the_servers_waits_and_hands_their_urls_to_the_trainer(tmp_path):
    from minirsi.engine.models import build_tiny_actor, build_tokenizer, save_actor

    tok = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    save_actor(build_tiny_actor(tok, seed=0), tok, tmp_path / "model")
    # the serving node's stand-in for serve_vllm.sh: `minirsi serve` on the port and host it is given
    serve = _exe(tmp_path / "serve.sh", f"#!/bin/bash\nexec {sys.executable} -m minirsi.cli serve --model \"$1\" "
                 "--port \"$2\" --host \"$HOST\" --served-model-name policy\n")
    port = _free_ports(2)
    proc = subprocess.run(["bash", str(JOB)], cwd=ROOT, env=_job_env(tmp_path, serve, port, tmp_path / "model"),
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads((tmp_path / "trained.json").read_text())
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]  # 2 GPUs / TP 1 on the serving node
    assert got["servers"] == urls and got["health"] == [200, 200] and got["tokens"] == [2, 2]
    assert got["argv"][:4] == ["--preset", "scale/configs/qwen3-32b-4x8.yaml", "--out", str(tmp_path / "run")]
    assert f"serving.sync_dir={tmp_path / 'run'}/weights" in got["argv"] and got["nccl"] == "1"
    assert "FITS" in proc.stdout  # the planner ran first
    assert all(_free(port + i) for i in range(2))  # the servers were stopped with the job


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_job_fails_naming_a_server_that_died(tmp_path):
    serve = _exe(tmp_path / "serve.sh", "#!/bin/bash\necho \"CUDA out of memory on $2\" >&2\nexit 1\n")
    proc = subprocess.run(["bash", str(JOB)], cwd=ROOT, env=_job_env(tmp_path, serve, _free_ports(2), tmp_path),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 1
    assert "exited before answering /health" in proc.stderr and "CUDA out of memory" in proc.stderr
    assert not (tmp_path / "trained.json").exists()  # the trainer never started
