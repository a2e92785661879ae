#!/usr/bin/env bash
# Serve a policy with vLLM for minirsi rollouts: token ids in, token ids and processed
# log-probs out, over vLLM's OpenAI-compatible /v1/completions; weights reloaded by the trainer.
#
#   pip install "minirsi[scale]"                  # on the GPU serving nodes only
#   bash scale/serve_vllm.sh RUN_DIR/stages/01-rsr1/actor 8000
#   minirsi rollout --server http://$(hostname):8000 --model RUN_DIR/stages/01-rsr1/actor ...
#
# Why these flags:
#   --host $HOST (default 0.0.0.0)      every interface: the trainer runs on other nodes. The dev
#                                       routes below reload weights: keep the port on a private
#                                       network (HOST=127.0.0.1 for a single-node test)
#   --logprobs-mode processed_logprobs  log-probs of the distribution actually sampled
#                                       (after temperature), what minirsi's PPO ratio needs
#   --generation-config vllm            vLLM's neutral sampling defaults, not the model's
#                                       generation_config.json (Qwen3's: top_k 20, top_p 0.95);
#                                       minirsi also sends every sampling field and ignore_eos
#                                       (minirsi/engine/sampler.py, OpenAISampler)
#   --return-tokens-as-token-ids        "token_id:N" strings, a fallback when a server build
#                                       lacks the per-request return_token_ids field
#   --max-logprobs 1                    minirsi asks only for the sampled token's log-prob
#   --served-model-name policy          a stable name while checkpoints change underneath
#   --worker-extension-cls              scale/serving/vllm_worker_ext.py: minirsi_load_weights(dir)
#   VLLM_SERVER_DEV_MODE=1              exposes /collective_rpc and /reset_prefix_cache, which
#                                       the trainer's weight sync calls: private network only
#   VLLM_ALLOW_RUNTIME_LORA_UPDATING    lets the trainer hot-load LoRA adapters
# Extra arguments go to `vllm serve` unchanged (e.g. --tensor-parallel-size 4 for 32B,
# --enable-lora --max-lora-rank 64 --max-loras 2 for LoRA hot-loading).
set -euo pipefail
MODEL="${1:?usage: serve_vllm.sh MODEL_NAME_OR_DIR [PORT] [vllm serve args...]}"
PORT="${2:-8000}"
shift $(( $# >= 2 ? 2 : 1 ))
HOST="${HOST:-0.0.0.0}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$HERE/serving${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_SERVER_DEV_MODE=1
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
exec "${VLLM:-vllm}" serve "$MODEL" \
  --host "$HOST" --port "$PORT" \
  --served-model-name policy \
  --logprobs-mode processed_logprobs \
  --generation-config vllm \
  --return-tokens-as-token-ids \
  --max-logprobs 1 \
  --enable-prefix-caching \
  --worker-extension-cls vllm_worker_ext.MinirsiWorkerExtension \
  "$@"
