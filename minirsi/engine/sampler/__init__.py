"""Samplers: token ids in, sampled token ids and their log-probs out.

docs/method.md section 3 asks for the exact ids the policy sampled and the sampler's log-probs, so a
sampler here never returns text that the caller would have to re-tokenise. Two backends share
one protocol::

    sampler.generate(prompts, max_new_tokens, temperature, stop_token_ids, seed) -> list[Sample]

* ``HFSampler(model, tokenizer)``: a Hugging Face causal LM in this process. All prompts are
  decoded together: left padding, an attention mask, position ids counted from each row's first
  real token, one KV cache for the whole batch; rows that stopped are dropped from the cache so
  the batch shrinks as replies end; each row's cache is kept so that the next turn's prompt
  (this one + action + observation) only encodes its new tokens (a prefix cache).
* ``OpenAISampler(base_urls, model)``: one or several OpenAI-compatible ``/v1/completions``
  servers that take token-id prompts and return token ids (``vllm serve``, SGLang, or
  ``minirsi serve``); each episode stays on one server (its prefix cache), a dead server is
  named and its episodes move or the call fails (``on_server_failure``).

Which log-probs. For temperature ``tau > 0`` a token is drawn from
``pi_tau(a | s) = softmax(z / tau)`` where ``z`` are the model's logits, and the log-prob
returned is ``log pi_tau(a | s) = log_softmax(z / tau)[a]``: the *processed* log-prob of the
distribution that was actually sampled (vLLM's ``--logprobs-mode processed_logprobs``). The
trainer must compute its log-probs with the same ``tau`` so that the PPO ratio is 1 on the
first epoch up to numerics. For ``tau == 0`` decoding is greedy (argmax) and the log-prob is
that of the untempered distribution, ``log_softmax(z)[a]``. No top-k / top-p filtering is
applied: it would make the sampled distribution differ from the one the trainer scores.

Stopping: a row ends at the first sampled id in ``stop_token_ids`` (that id is kept as the last
sampled id, ``finish_reason == "stop"``) or after ``max_new_tokens`` ids (``"length"``).

Reproducibility: with a ``seed`` every random draw comes from one ``torch.Generator`` seeded
with it, so the same prompts, batch and seed give the same ids. Across batch compositions the
ids can differ (padding changes float rounding in the logits), so a rollout is reproducible
when its whole schedule is.

Backends: ``hf.py`` (in-process) and ``openai_compat.py`` (servers); ``base.py`` holds what they share.
"""

from minirsi.engine.sampler.base import FINISH_LENGTH, FINISH_STOP, Sample, Sampler
from minirsi.engine.sampler.hf import HFSampler
from minirsi.engine.sampler.openai_compat import (
    FULL_DISTRIBUTION,
    ON_SERVER_FAILURE,
    OpenAISampler,
    OpenAISamplerError,
    ServerDown,
    server_base,
)

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "FULL_DISTRIBUTION", "ON_SERVER_FAILURE", "HFSampler", "OpenAISampler",
           "OpenAISamplerError", "Sample", "Sampler", "ServerDown", "server_base"]
