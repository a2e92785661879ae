"""The action format of an agent turn, and how prompts, observations and sessions become ids.

docs/method.md section 3. An episode's token sequence is ChatML (the format Qwen models are tuned on):

    <|im_start|>system\\n{SYSTEM_PROMPT}<|im_end|>\\n<|im_start|>user\\n{instruction}<|im_end|>\\n
    <|im_start|>assistant\\n                                  <- render_prompt_ids ends here
    {action 0}<|im_end|>                                      <- sampled by the policy
    \\n<|im_start|>user\\n{observation 1}<|im_end|>\\n<|im_start|>assistant\\n
                                                              <- render_observation_ids
    {action 1}<|im_end|>  ...

``<|im_end|>`` is the last token of every action (the sampler's stop token, kept in the
sequence, masked as an action token); everything from the following ``\\n`` to the next
``assistant\\n`` is the observation, written by the harness.

The action format
-----------------
A reply runs shell commands by putting them in a fenced block, ```` ```bash ... ``` ````
(the tags ``sh``, ``shell`` and no tag are accepted too). Each block is sent to the episode's
persistent shell as ONE script (cwd and variables persist between blocks and turns); a reply may
hold several blocks, run in order. The reply signals completion with the word ``TASK_COMPLETE``
outside any block. A reply may run a block AND complete: the block runs, its output is not
shown to the agent, and the episode ends (the verifier runs next). A reply with no non-empty
block and no ``TASK_COMPLETE`` (free text, an empty block, an unclosed fence, a ```` ```python````
block) runs nothing; the harness answers it with ``FORMAT_REMINDER`` and the episode goes on,
counted in ``Episode.parse_errors``. A closed block before an unclosed fence still runs.

Tokenisation consistency
------------------------
Ids are built by appending segments (special tokens by id, text pieces encoded on their own),
never by tokenising a whole transcript, so the prompt and observation ids are the same in a
rollout and in supervised data. Actions differ in where their ids come from: in a rollout they
are the ids the sampler drew (kept verbatim; BPE does not promise encode(decode(ids)) == ids,
so they are never re-encoded); in pretraining / SFT (``render_session``) they are
``encode(action_text) + [<|im_end|>]``, the canonical tokenisation, which is one sequence the
model could sample. Both are correct training sequences for their own source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from transformers import PreTrainedTokenizerBase

COMPLETE = "TASK_COMPLETE"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
"""ChatML's turn markers; IM_END ends every turn and is the sampler's stop token."""

SYSTEM_PROMPT = (
    "You are in a Linux shell. Reply with commands in a ```bash block; you will see their "
    f"output. When the task is done, reply {COMPLETE}."
)
"""Short on purpose: every prompt token is computed in every forward pass of every episode."""

FORMAT_REMINDER = f"No command found. Put commands in a ```bash block, or reply {COMPLETE} when done."
"""The observation that answers a reply which parsed to no command and no completion."""

OBS_MAX_CHARS = 800
"""Observation text cap (characters) per command block: head and tail are kept."""

_SHELL_TAGS = ("", "bash", "sh", "shell")
_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[ \t]*$", re.MULTILINE)  # an opening line
_COMPLETE = re.compile(rf"\b{COMPLETE}\b")


@dataclass(frozen=True)
class ParsedAction:
    """What a reply asks the harness to do.

    ``commands``: one script per non-empty shell block, in order. ``done``: the reply says
    TASK_COMPLETE (outside blocks). ``error``: set exactly when the reply runs nothing and does
    not complete (the harness then answers with FORMAT_REMINDER); it says what was wrong.
    """

    commands: list[str]
    done: bool
    error: str | None = None


def parse_action(text: str) -> ParsedAction:
    """Parse an assistant reply (decoded, special tokens removed) into commands and done.

    Examples:
        "```bash\\nls -la\\n```"                   -> commands=["ls -la"], done=False
        "```bash\\necho hi > f\\n```\\nTASK_COMPLETE" -> commands=["echo hi > f"], done=True
        "TASK_COMPLETE"                            -> commands=[], done=True
        "I will list the files."                   -> commands=[], error="no ```bash block ..."
    """
    commands: list[str] = []
    outside: list[str] = []  # text outside blocks, where TASK_COMPLETE counts
    problems: list[str] = []
    pos = 0
    while True:
        m = _FENCE.search(text, pos)
        if m is None:
            outside.append(text[pos:])
            break
        outside.append(text[pos : m.start()])
        close = text.find("```", m.end())
        if close < 0:
            problems.append("a ``` fence is never closed")
            break  # the reply was cut (or malformed) inside a block: run nothing of it
        body = text[m.end() : close].strip("\n")
        tag = m.group(1).lower()
        if tag not in _SHELL_TAGS:
            problems.append(f"a ```{tag} block is not a shell block (use ```bash)")
        elif not body.strip():
            problems.append("a ```bash block is empty")
        else:
            commands.append(body)
        pos = close + 3
    done = bool(_COMPLETE.search("".join(outside)))
    error = None
    if not commands and not done:
        error = "; ".join(problems) if problems else f"no ```bash block and no {COMPLETE}"
    return ParsedAction(commands=commands, done=done, error=error)


def action_text(commands: Sequence[str] | str, done: bool = False) -> str:
    """The canonical reply text for ``commands`` (one block) and/or completion: what
    ``parse_action`` reads back exactly (``parse_action(action_text(c)).commands == [c]``)."""
    script = commands if isinstance(commands, str) else "\n".join(commands)
    parts = []
    if script.strip():
        parts.append(f"```bash\n{script.strip(chr(10))}\n```")
    if done:
        parts.append(COMPLETE)
    if not parts:
        raise ValueError("action_text needs at least one command or done=True")
    return "\n".join(parts)


class ResultLike(Protocol):
    """What format_observation reads from a command result (sandbox.CommandResult has it)."""

    output: str
    exit_code: int | None
    timed_out: bool
    truncated: bool


def _cap(text: str, max_chars: int) -> str:
    """Keep the first and last max_chars/2 characters (a listing's head, an error's tail)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[len(text) - half:]}"


def format_observation(results: Sequence[ResultLike], max_chars: int = OBS_MAX_CHARS) -> str:
    """The observation text for the results of one reply's blocks, in a short stable format:

        <output of block 1, capped>
        [exit 0]
        <output of block 2, capped>
        [exit 1]

    A timed-out block ends with ``[timed out]``, a block whose shell reported no status with
    ``[no exit code]``; ``[output truncated]`` marks output the sandbox itself cut.
    """
    if max_chars < 20:
        raise ValueError(f"max_chars={max_chars}: too small to show any output; use >= 20")
    pieces = []
    for r in results:
        out = _cap(r.output.rstrip("\n"), max_chars)
        if r.truncated:
            out += "\n[output truncated]"
        if r.timed_out:
            status = "[timed out]"
        elif r.exit_code is None:
            status = "[no exit code]"
        else:
            status = f"[exit {r.exit_code}]"
        pieces.append(f"{out}\n{status}" if out else status)
    return "\n".join(pieces)


_STATUS = re.compile(r"^\[(exit (-?\d+)|timed out|no exit code)\]$", re.MULTILINE)


def read_blocks(commands: Sequence[str], observation: str | None) -> list[tuple[str, str, bool]]:
    """The inverse of ``format_observation``: per command block of a turn, (command, output,
    exited 0). Status lines are matched to the blocks from the end; when there are fewer than
    blocks, every block counts as failed unless every status line says exit 0; a turn with no
    observation (its sandbox died, or it completed) counts as failed."""
    n = len(commands)
    if observation is None:
        return [(c, "", False) for c in commands]
    found = list(_STATUS.finditer(observation))
    statuses = [m.group(2) == "0" for m in found]
    ok = statuses[-n:] if len(statuses) >= n else [bool(statuses) and all(statuses)] * n
    pieces, start = [], 0
    for m in found:
        pieces.append(observation[start:m.start()].strip("\n"))
        start = m.end()
    pieces = pieces[-n:] if n else []
    outputs = [""] * (n - len(pieces)) + pieces
    return list(zip(commands, outputs, ok[:n] if n else []))


def bare_command(block: str) -> str:
    """A command block without its comment lines (an agent may open a block with one)."""
    return "\n".join(x for x in block.splitlines() if not x.lstrip().startswith("#")).strip()


# --- token ids --------------------------------------------------------------------------------


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Encode plain text; special-token strings inside it (``<|im_end|>`` printed by a command)
    are split into ordinary bytes, so an observation cannot forge a turn boundary."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def special_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of a ChatML special token (``IM_START``, ``IM_END``); a tokenizer without it raises."""
    i = tokenizer.convert_tokens_to_ids(token)
    if i is None or i == getattr(tokenizer, "unk_token_id", None):
        raise ValueError(f"tokenizer has no {token} token; use a ChatML tokenizer (models.build_tokenizer, Qwen)")
    return int(i)


def _message_ids(tokenizer: PreTrainedTokenizerBase, role: str, content: str) -> list[int]:
    """'<|im_start|>{role}\\n{content}<|im_end|>' (no trailing newline)."""
    return (
        [special_id(tokenizer, IM_START)]
        + _text_ids(tokenizer, f"{role}\n")
        + _text_ids(tokenizer, content)
        + [special_id(tokenizer, IM_END)]
    )


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, instruction: str, system: str = SYSTEM_PROMPT
) -> list[int]:
    """System message, user instruction and the assistant header; the policy continues it.

    Decodes to ``tokenizer.apply_chat_template([system, user], add_generation_prompt=True)``.
    """
    nl = _text_ids(tokenizer, "\n")
    return (
        _message_ids(tokenizer, "system", system)
        + nl
        + _message_ids(tokenizer, "user", instruction)
        + nl
        + [special_id(tokenizer, IM_START)]
        + _text_ids(tokenizer, "assistant\n")
    )


def render_observation_ids(tokenizer: PreTrainedTokenizerBase, observation: str) -> list[int]:
    """'\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n': appended
    after an action's final ``<|im_end|>`` to prompt the next action."""
    nl = _text_ids(tokenizer, "\n")
    return (
        nl
        + _message_ids(tokenizer, "user", observation)
        + nl
        + [special_id(tokenizer, IM_START)]
        + _text_ids(tokenizer, "assistant\n")
    )


def render_action_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """encode(text) + [<|im_end|>]: the canonical ids of an action written as text (SFT)."""
    return _text_ids(tokenizer, text) + [special_id(tokenizer, IM_END)]


def decode_action(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """Sampled action ids -> the text parse_action reads (special tokens dropped)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def session_turns(session: Any) -> list[tuple[str, str | None]]:
    """(action text, observation text or None) per assistant turn of a structured session.

    ``session.turns`` holds objects with ``commands`` (list of str, or one str), ``output`` and
    ``exit_code``: each becomes a ```bash block answered by its observation. A final
    ``TASK_COMPLETE`` reply (no observation) closes the session.
    """
    out: list[tuple[str, str | None]] = []
    for turn in session.turns:
        result = _TurnResult(output=turn.output, exit_code=turn.exit_code)
        out.append((action_text(turn.commands), format_observation([result])))
    out.append((action_text([], done=True), None))
    return out


@dataclass
class _TurnResult:
    output: str
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False


def render_session(
    tokenizer: PreTrainedTokenizerBase, session: Any, system: str = SYSTEM_PROMPT
) -> tuple[list[int], list[int], list[int]]:
    """A structured session -> (token_ids, action_mask, turn_ids) for pretraining / SFT.

    Built exactly like a rollout (prompt ids, then action ids and observation ids appended turn
    by turn), with turn_ids following minirsi/core/episode.py: 0 on the prompt and action 0, k on
    action k, k + 1 on the observation after action k. The sequence ends on the final
    ``TASK_COMPLETE<|im_end|>`` action, so its last token is an action token.
    """
    ids = render_prompt_ids(tokenizer, session.instruction, system)
    mask = [0] * len(ids)
    turn_ids = [0] * len(ids)
    for k, (act, obs) in enumerate(session_turns(session)):
        a = render_action_ids(tokenizer, act)
        ids += a
        mask += [1] * len(a)
        turn_ids += [k] * len(a)
        if obs is not None:
            o = render_observation_ids(tokenizer, obs)
            ids += o
            mask += [0] * len(o)
            turn_ids += [k + 1] * len(o)
    return ids, mask, turn_ids
