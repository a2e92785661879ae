"""What every sampler backend shares: the reply (``Sample``), the protocol, the argument checks
(minirsi.engine.sampler's docstring says what the log-probs are)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

FINISH_STOP = "stop"
FINISH_LENGTH = "length"



@dataclass
class Sample:
    """One generated reply."""

    token_ids: list[int]
    """The sampled ids, in order; ends with the stop id when ``finish_reason == "stop"``."""
    logprobs: list[float]
    """``log pi_tau(a_t | s_t)`` of each sampled id (see the module docstring)."""
    finish_reason: str
    """``"stop"`` (a stop id was sampled) or ``"length"`` (``max_new_tokens`` reached)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Sample has {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs; "
                "the backend must return one log-prob per sampled id"
            )


class Sampler(Protocol):
    """Anything that turns token-id prompts into ``Sample`` replies."""

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        seed: int | None = None,
    ) -> list[Sample]: ...


def _check_args(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 means greedy decoding)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token id")
