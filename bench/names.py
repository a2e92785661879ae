"""Where a Base's name errors are: which names it copies wrong, teacher-forced, on the held-out
corpus sessions that ``minirsi pretrain`` measures name accuracy on.

Each name token of an action (``pretrain.name_positions``) is split by where the same name
stands earlier in the context (``source``): on the step's line that the command just above
printed (``sed -n Kp steps.txt``), in another output just above (``ls``, ``cat``, an error), in
the same block, further up, or nowhere (the demonstrator's retry names a missing file on
purpose). A wrong prediction is another name of the context, a name the context does not hold,
or not a name.

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

FENCE = "```bash\n"
SOURCES = ("the step's line just above", "another output just above", "this block", "further up", "nowhere")


def source(word: str, before: str) -> str:
    """Where ``word`` stands in ``before``, the rendered context up to the name (its block open):
    one of ``SOURCES``."""
    block = before.rfind(FENCE)
    here = before[block + len(FENCE):]
    prev = before.rfind(FENCE, 0, block)  # the block above, then what the shell printed for it
    above = before[prev + len(FENCE):block] if prev >= 0 else ""
    command, _, output = above.partition("\n```")
    has = lambda text: re.search(rf"(?<![a-z]){word}(?![a-z])", text) is not None  # noqa: E731
    if has(here):
        return "this block"
    if has(output):
        return "the step's line just above" if command.startswith("sed -n ") else "another output just above"
    return "further up" if has(before[:block]) else "nowhere"


def tally(model, tok, sessions, max_len: int) -> dict:
    names = pretrain.name_words()
    kinds: collections.Counter = collections.Counter()
    by_source: dict[str, list[int]] = {k: [0, 0] for k in SOURCES}
    for s in sessions:
        ids, mask = actions.render_session(tok, s)[:2]
        if len(ids) > max_len:
            continue
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist()
        toks = tok.convert_ids_to_tokens(ids)
        for t in pretrain.name_positions(tok, ids, mask, names):
            before = tok.decode(ids[:t])
            where = source(toks[t].lstrip("Ġ"), before)
            in_context = set(re.findall(r"[a-z]+", before)) & names
            guess = tok.convert_ids_to_tokens([pred[t - 1]])[0].lstrip("Ġ")
            ok = pred[t - 1] == ids[t]
            kinds[where, "right" if ok else "another name of the context" if guess in in_context
                  else "a name not in the context" if guess in names else "not a name"] += 1
            by_source[where][0] += ok
            by_source[where][1] += 1
    return {"kinds": {f"{w}: {k}": n for (w, k), n in sorted(kinds.items())},
            "by_source": {k: v for k, v in by_source.items() if v[1]}}


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
        print(f"{k:60s} {n}")
    right = sum(a for a, _ in out["by_source"].values())
    total = sum(b for _, b in out["by_source"].values())
    print(f"names right: {right}/{total} = {right / max(total, 1):.3f}; by where the name stands: "
          + ", ".join(f"{k}: {a}/{b} = {a / b:.3f}" for k, (a, b) in out["by_source"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
