"""The ``minirsi`` command line.

Each sub-command lives in the module that implements it, as a function ``cli(argv)``
that builds its own ``argparse`` parser. This file only dispatches, importing just the module
it needs, so ``minirsi task check`` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). Order is the order a learner meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "task": ("minirsi.env.task_cli", "validate tasks and replay commands in a sandbox"),
    "pretrain": ("minirsi.run.pretrain", "train the tiny Base model on generated shell sessions"),
    "rollout": ("minirsi.engine.rollout", "run the agent on tasks and write episodes as JSONL"),
    "serve": ("minirsi.engine.serve", "serve a model over an OpenAI-compatible completions API"),
    "run": ("minirsi.run.recipe", "the five-stage recipe: Base -> RSR-1 -> RPR-1 -> RSR-2 -> RPR-2"),
    "eval": ("minirsi.run.evaluate", "Mean@3 of a checkpoint on the toy suites"),
    "report": ("minirsi.run.report", "write the Markdown report and plots of a run"),
    "audit": ("minirsi.run.report", "rescore a run's episodes under FDR and SPR"),
    "plan": ("minirsi.run.memplan", "memory per GPU and step time of a sharded run, before queueing it"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: minirsi COMMAND [options]   (minirsi COMMAND --help for each)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"minirsi: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    entry = getattr(module, "cli")
    return int(entry(rest, command=name) or 0)


if __name__ == "__main__":
    sys.exit(main())
