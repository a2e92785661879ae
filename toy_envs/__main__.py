"""``python -m toy_envs SUITE OUT_DIR [--n N] [--seed S]``: write a toy suite to OUT_DIR.

``python -m toy_envs samples toy_envs/samples`` rewrites the committed samples;
``python -m toy_envs rates`` prints the demonstrator's analytic success on the dev split
(what toy_envs/obstacles.py's rates were fixed from).
"""

from __future__ import annotations

import argparse
import sys

import json

from toy_envs.suites import SUITES, generate_suite, write_samples


def main(argv: list[str] | None = None) -> int:
    if (argv if argv is not None else sys.argv[1:])[:1] == ["rates"]:
        from toy_envs.obstacles import dev_report

        print(json.dumps(dev_report(), indent=1))
        return 0
    parser = argparse.ArgumentParser(prog="python -m toy_envs", description="Write a toy task suite (Harbor layout).")
    parser.add_argument("suite", choices=[*SUITES, "samples"], help="which suite ('samples': the committed samples)")
    parser.add_argument("out_dir", help="directory to write the task directories into")
    parser.add_argument("--n", type=int, default=None, help="number of tasks (default: the suite's size)")
    parser.add_argument("--seed", type=int, default=0, help="generation seed (default 0)")
    args = parser.parse_args(argv)
    if args.suite == "samples":
        print(f"wrote {len(write_samples(args.out_dir))} sample tasks to {args.out_dir}")
        return 0
    try:
        paths = generate_suite(args.suite, args.out_dir, n=args.n, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} tasks of suite {args.suite} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
