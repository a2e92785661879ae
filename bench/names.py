"""Where a Base's name errors are: which names it copies wrong, teacher-forced, on the held-out
corpus sessions that ``minirsi pretrain`` measures name accuracy on.

Each name token of an action (``pretrain.name_positions``) is counted on the line it sits on: a
comment (``# 2. Copy ...``, restating an instruction line) or a command (copying the comment
one line up). A wrong prediction is another name of the same instruction, a name the
instruction does not hold, or not a name. Comment names are also split by the numbered comment
before them (none; the same instruction line again, as the demonstrator writes on a fix or a
repeat; or a new line), by the instruction line they restate and by their place in the line; a
wrong name on a new line is also checked against the previous comment's names. Last, each
comment name is split by what the token before it points to (``word_before``): a head that
copies what followed that token's earlier occurrences (an induction head) finds only this name,
finds another token too, or finds nothing.

    python3 bench/names.py --model minirsi/presets/toy-base
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import torch

from minirsi.core import actions
from minirsi.engine.models import load_actor
from minirsi.run import pretrain


NUMBERED = re.compile(r"#\s*(\d+)\.")
"""A comment restating a numbered instruction line (``# 2. Copy ...``); group 1 is the number."""


def word_before(ids: list[int], t: int, start: int) -> str:
    """What the token before name ``t`` points to in ``ids[:start]`` (the context before its
    line): "only this name" when every earlier occurrence of ``ids[t - 1]`` is followed by
    ``ids[t]``, "another token too" when one is followed by something else, "nothing" when it
    does not occur."""
    after = {ids[u] for u in range(1, start) if ids[u - 1] == ids[t - 1]}
    return "nothing" if not after else "only this name" if after == {ids[t]} else "another token too"


def tally(model, tok, sessions, max_len: int) -> dict:
    names = pretrain.name_words()
    kinds: collections.Counter = collections.Counter()
    by_prev: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    new_line_from_prev = 0  # wrong names of a comment on a new line that are a name of the previous comment
    by_line: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    by_place: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    by_word: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for s in sessions:
        ids, mask = actions.render_session(tok, s)[:2]
        if len(ids) > max_len:
            continue
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist()
        toks = tok.convert_ids_to_tokens(ids)
        in_instruction = set(re.findall(r"[a-z]+", s.instruction)) & names
        prev_of: dict[int, str] = {}  # line start -> the numbered comment line before it ("" if none)
        for t in pretrain.name_positions(tok, ids, mask, names):
            start = t
            while start > 0 and not toks[start - 1].endswith("Ċ"):
                start -= 1
            line = tok.decode(ids[start : t + 1]).lstrip()
            where = "comment" if line.startswith("#") else "command"
            guess = tok.convert_ids_to_tokens([pred[t - 1]])[0].lstrip("Ġ")
            ok = pred[t - 1] == ids[t]
            kinds[where, "right" if ok else "another instruction name" if guess in in_instruction
                  else "a name not in the instruction" if guess in names else "not a name"] += 1
            if where == "comment":
                number = NUMBERED.match(line)
                # the numbered comment before this one: the same instruction line again, or another
                if start not in prev_of:
                    before = [x for x in tok.decode(ids[:start]).splitlines() if NUMBERED.match(x)]
                    prev_of[start] = before[-1] if before else ""
                prev = prev_of[start]
                again = bool(number and prev) and NUMBERED.match(prev).group(1) == number.group(1)
                if not ok and not again and guess in set(re.findall(r"[a-z]+", prev)) & names:
                    new_line_from_prev += 1
                kind = "first numbered comment" if not prev else "the previous comment's line again" if again \
                    else "a new line"
                for cell in (by_prev[kind], by_word[f"{kind}; the token before points to {word_before(ids, t, start)}"],
                             by_line[number.group(1) if number else "-"],
                             by_place[sum(toks[i].lstrip("Ġ") in names for i in range(start, t))]):
                    cell[0] += ok
                    cell[1] += 1
    return {"kinds": {f"{w}: {k}": n for (w, k), n in sorted(kinds.items())},
            "comment_by_previous_comment": {k: v for k, v in sorted(by_prev.items())},
            "wrong_new_line_names_from_the_previous_comment": new_line_from_prev,
            "comment_by_instruction_line": {k: v for k, v in sorted(by_line.items())},
            "comment_by_place_in_line": {str(k): v for k, v in sorted(by_place.items())},
            "comment_by_previous_comment_and_word_before": {k: v for k, v in sorted(by_word.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "minirsi" / "presets" / "toy-base"),
                    help="a Base (or any actor) directory (default: the shipped Base)")
    ap.add_argument("--sessions", type=int, default=256, help="held-out sessions (pretrain's val_sessions)")
    ap.add_argument("--seed", type=int, default=0, help="the pretrain seed the held-out sessions derive from")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--json", action="store_true", help="print the tallies as JSON")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_actor(args.model)
    model.eval()
    cfg = pretrain.PretrainConfig(val_sessions=args.sessions, seed=args.seed, max_len=args.max_len)
    out = tally(model, tok, pretrain.held_out_sessions(cfg), cfg.max_len)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for k, n in out["kinds"].items():
        print(f"{k:45s} {n}")
    print(f"{'comment, a new line: wrong, a name of the previous comment':45s} "
          f"{out['wrong_new_line_names_from_the_previous_comment']}")
    for title, key in (("comment names by the comment before them", "comment_by_previous_comment"),
                       ("comment names by the instruction line they restate", "comment_by_instruction_line"),
                       ("comment names by their place in the line", "comment_by_place_in_line"),
                       ("comment names by the comment before them and what the token before them points to",
                        "comment_by_previous_comment_and_word_before")):
        print(title + ": " + ", ".join(f"{k}: {a}/{b} = {a / b:.2f}" for k, (a, b) in out[key].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
