"""Reports of a run: the stages x suites table, per-difficulty results, plots, the reward audit.

``minirsi report RUN_DIR`` reads ``results.json``, ``metrics.jsonl`` and ``stages/*/DONE.json``
and writes ``RUN_DIR/report.md`` with

* the stages x suites table of Mean@k (as the paper's main table), each cell with its standard
  error over tasks (minirsi/run/evaluate.py), and the equal-weight mean over the suites in the last
  column: mean_s Mean@k(s);
* the failure taxonomy per stage on the first suite (minirsi/run/failures.py): what each stage's
  failed episodes failed at, so a learner sees what a stage fixed;
* the training pool's success within each RPR stage (first vs last steps and the slope with its
  standard error, from metrics.jsonl);
* per-difficulty Mean@k, pooled over the evaluated suites weighting each suite's difficulty
  group by its number of tasks (the paper pools its 322 benchmark-task pairs the same way);
* process reward P / C and strict completion on the long-horizon suite;
* PNG plots (matplotlib, Agg backend, no display needed): ``success.png`` (Mean@k per stage
  and suite) and ``signals.png`` (training signals over the update steps of every stage that
  logged them: dense reward, binary reward, turns, explained variance, log-prob gap).

``minirsi audit RUN_DIR`` rescores every stored episode of the run (``stages/*/episodes.jsonl``,
the training rollouts; ``--eval`` adds the evaluation episodes) under FDR and SPR with the
run's frozen calibration and prints the paper's audit figures (docs/method.md section 2): the failed
share of reward mass sum_{failed} r / sum_{all} r, failures scoring >= 1, and failures that
passed every executed check. Both commands are served by ``cli(argv, command)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

logger = logging.getLogger(__name__)

DIFFICULTIES = ("easy", "medium", "hard", "extreme")
SIGNALS = (
    ("dense_reward", "dense reward (FDR)"),
    ("binary_reward", "binary reward (S)"),
    ("pool_success", "training-pool success (S of a uniform draw, estimated)"),
    ("turns", "turns per episode"),
    ("explained_variance", "explained variance"),
    ("logprob_gap", "|logp_train - logp_sample|"),
)
DEFAULT_LABELS = {"base": "Base", "rsr1": "RSR-1", "rpr1": "RPR-1", "rsr2": "RSR-2", "rpr2": "RPR-2",
                  "direct_ppo": "Direct PPO", "rpr2_critic_reset": "RPR-2, critic reset",
                  "rpr1_token_gae": "RPR-1, per-token GAE", "warmup": "Warm-up critic"}


def difficulty_order(names) -> list[str]:
    """The difficulties among ``names`` in DIFFICULTIES order, then any others sorted."""
    return [d for d in DIFFICULTIES if d in names] + sorted(set(names) - set(DIFFICULTIES))


def _k_of(results: Mapping[str, Any]) -> int:
    for suites in results.values():
        for r in suites.values():
            for key in r:
                if key.startswith("mean_at_"):
                    return int(key.split("_")[-1])
    return 3


def _suites(results: Mapping[str, Any]) -> list[str]:
    seen: list[str] = []
    for suites in results.values():
        seen += [s for s in suites if s not in seen]
    return seen


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def stage_labels(run_dir: str | Path | None, names: Sequence[str]) -> dict[str, str]:
    """Display names of stages: from DONE.json when the run has it, else the paper's names."""
    labels = {n: DEFAULT_LABELS.get(n, n) for n in names}
    if run_dir is not None:
        for done in sorted(Path(run_dir).glob("stages/*/DONE.json")):
            rec = json.loads(done.read_text())
            if rec.get("stage") in labels and rec.get("label"):
                labels[rec["stage"]] = rec["label"]
    return labels


def _cell(r: Mapping[str, Any] | None, k: int) -> str:
    if not r or f"mean_at_{k}" not in r:
        return "-"
    se = r.get("stderr")
    return _pct(r[f"mean_at_{k}"]) + ("" if se is None else f" ± {100 * se:.1f}")


def results_table(results: Mapping[str, Any], k: int | None = None, labels: Mapping[str, str] | None = None) -> str:
    """Markdown: one row per stage, Mean@k (%) ± its standard error per suite, and their
    equal-weight mean."""
    if not results:
        return "(no stage has been evaluated yet)"
    k = k or _k_of(results)
    suites = _suites(results)
    labels = labels or {n: DEFAULT_LABELS.get(n, n) for n in results}
    lines = ["| Stage | " + " | ".join(suites) + " | Mean |", "|---" * (len(suites) + 2) + "|"]
    for stage, by_suite in results.items():
        vals = [by_suite.get(s, {}).get(f"mean_at_{k}") for s in suites]
        present = [v for v in vals if v is not None]
        mean = sum(present) / len(present) if present else None
        cells = [_cell(by_suite.get(s), k) for s in suites]
        lines.append(f"| {labels.get(stage, stage)} | " + " | ".join(cells) + f" | {_pct(mean)} |")
    return "\n".join(lines)


def failure_table(results: Mapping[str, Any], suite: str | None = None, labels: Mapping[str, str] | None = None) -> str:
    """Markdown: per stage, its failed episodes on ``suite`` (default: the first suite) by
    category (minirsi/run/failures.py), as counts."""
    from minirsi.run.failures import CATEGORIES

    suite = suite or (_suites(results) or [None])[0]
    rows = [(st, r[suite]["failures"]) for st, r in results.items() if suite in r and "failures" in r[suite]]
    if not rows:
        return f"(no failure taxonomy recorded for suite '{suite}')"
    labels = labels or {n: DEFAULT_LABELS.get(n, n) for n in results}
    lines = ["| Stage | failed | " + " | ".join(CATEGORIES) + " |", "|---" * (len(CATEGORIES) + 2) + "|"]
    for st, f in rows:
        lines.append(f"| {labels.get(st, st)} | {f['n_failed']} | "
                     + " | ".join(str(f["counts"].get(c, 0)) for c in CATEGORIES) + " |")
    return "\n".join(lines)


def trend(ys: Sequence[float]) -> tuple[float, float | None]:
    """Least-squares slope of ``ys`` against 0, 1, 2, ... and its standard error (residual
    variance over n - 2; None under three points). A curve of noisy steps rises when the slope
    is more than about two standard errors above 0, not when its last steps beat its first."""
    n = len(ys)
    if n < 2:
        return 0.0, None
    mx, my = (n - 1) / 2, sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    slope = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
    if n < 3:
        return slope, None
    rss = sum((y - my - slope * (i - mx)) ** 2 for i, y in enumerate(ys))
    return slope, (rss / (n - 2) / sxx) ** 0.5


def pool_table(metrics: Sequence[Mapping[str, Any]], labels: Mapping[str, str], n: int = 3) -> str:
    """Markdown: per RPR stage, the training pool's success over its first ``n`` logged steps
    (critic calibration included) and its last ``n``, and the slope over all of them in points
    a step with its standard error (``trend``): ``pool_success``, what a uniform draw of the pool
    would measure (``EdgeStream.pool_success``: each drawn bucket's success weighed by its share
    of the pool), or for runs logged before it the drawn episodes' ``binary_reward``."""
    stages: dict[str, list[float]] = {}
    for m in metrics:
        y = m.get("pool_success", m.get("binary_reward"))
        if m.get("phase") in ("calibrate", "joint") and isinstance(y, (int, float)):
            stages.setdefault(m["stage"], []).append((m["step"], y))
    if not stages:
        return "(no RPR stage logged its training rollouts)"
    lines = [f"| Stage | steps | success, first {n} | success, last {n} | slope, points a step (s.e.) |",
             "|---|---|---|---|---|"]
    for st, pts in stages.items():
        ys = [y for _, y in sorted(pts)]
        slope, se = trend(ys)
        lines.append(f"| {labels.get(st, st)} | {len(ys)} | {_pct(sum(ys[:n]) / len(ys[:n]))} | "
                     f"{_pct(sum(ys[-n:]) / len(ys[-n:]))} | {100 * slope:+.2f} ({_pct(se, 2)}) |")
    return "\n".join(lines)


def pooled_by_difficulty(by_suite: Mapping[str, Any]) -> dict[str, float]:
    """Mean@k per difficulty over all suites, each suite's group weighted by its task count."""
    num: dict[str, float] = {}
    den: dict[str, int] = {}
    for r in by_suite.values():
        counts = r.get("n_by_difficulty", {})
        for d, v in r.get("by_difficulty", {}).items():
            n = int(counts.get(d, 1))
            num[d] = num.get(d, 0.0) + v * n
            den[d] = den.get(d, 0) + n
    return {d: num[d] / den[d] for d in difficulty_order(num)}


def difficulty_table(results: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> str:
    """Markdown: one row per stage, pooled Mean@k (%) per difficulty (task counts in the header)."""
    if not results:
        return "(no stage has been evaluated yet)"
    labels = labels or {n: DEFAULT_LABELS.get(n, n) for n in results}
    pooled = {s: pooled_by_difficulty(r) for s, r in results.items()}
    diffs = difficulty_order({d for p in pooled.values() for d in p})
    first = next(iter(results.values()))
    n = {d: sum(int(r.get("n_by_difficulty", {}).get(d, 0)) for r in first.values()) for d in diffs}
    head = [f"{d} (n={n[d]})" if n[d] else d for d in diffs]
    lines = ["| Stage | " + " | ".join(head) + " |", "|---" * (len(diffs) + 1) + "|"]
    for stage, p in pooled.items():
        lines.append(f"| {labels.get(stage, stage)} | " + " | ".join(_pct(p.get(d)) for d in diffs) + " |")
    return "\n".join(lines)


def long_table(results: Mapping[str, Any], suite: str = "long", labels: Mapping[str, str] | None = None) -> str:
    """Markdown: process reward P/C and strict completion per stage on the long-horizon suite."""
    labels = labels or {n: DEFAULT_LABELS.get(n, n) for n in results}
    rows = [(s, r[suite]) for s, r in results.items() if suite in r and "process_reward" in r[suite]]
    if not rows:
        return f"(no stage was evaluated on the '{suite}' suite)"
    lines = ["| Stage | process reward P/C | strict completion |", "|---|---|---|"]
    for stage, r in rows:
        sc = r.get("strict_completion", {})
        lines.append(f"| {labels.get(stage, stage)} | {r['process_reward']:.3f} | "
                     f"{sc.get('completed', '-')}/{sc.get('tasks', '-')} |")
    return "\n".join(lines)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl records (a torn last line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_success(results: Mapping[str, Any], path: Path, labels: Mapping[str, str]) -> Path:
    """Grouped bars: Mean@k (%) per stage, one bar per suite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = _k_of(results)
    suites = _suites(results)
    stages = list(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(stages)), 3.6))
    width = 0.8 / max(1, len(suites))
    for j, s in enumerate(suites):
        ys = [100 * results[st].get(s, {}).get(f"mean_at_{k}", 0.0) for st in stages]
        ax.bar([i + (j - (len(suites) - 1) / 2) * width for i in range(len(stages))], ys, width, label=s)
    ax.set_xticks(range(len(stages)), [labels.get(st, st) for st in stages], rotation=20)
    ax.set_ylabel(f"Mean@{k} strict success (%)")
    ax.set_title("Success per stage")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_signals(metrics: Sequence[Mapping[str, Any]], path: Path, labels: Mapping[str, str]) -> Path | None:
    """One panel per training signal, one line per stage, against that stage's update step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(key, title) for key, title in SIGNALS if any(key in m for m in metrics)]
    if not present:
        return None
    stages: list[str] = []
    for m in metrics:
        if m.get("stage") not in stages:
            stages.append(m.get("stage"))
    color = {st: f"C{i % 10}" for i, st in enumerate(stages)}  # one colour per stage in every panel
    fig, axes = plt.subplots(1, len(present), figsize=(3.2 * len(present), 3.4), squeeze=False)
    for ax, (key, title) in zip(axes[0], present):
        for st in stages:
            pts = [(m["step"], m[key]) for m in metrics
                   if m.get("stage") == st and isinstance(m.get(key), (int, float))]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker=".", label=labels.get(st, st), color=color[st])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("update step", fontsize=8)
        ax.grid(alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir: str | Path) -> Path:
    """Write RUN_DIR/report.md, RUN_DIR/success.png and RUN_DIR/signals.png; returns report.md."""
    run_dir = Path(run_dir)
    results_path = run_dir / "results.json"
    if not results_path.is_file():
        raise ValueError(f"{results_path} not found: is {run_dir} a run directory with an evaluated stage?")
    results = json.loads(results_path.read_text())
    metrics = read_metrics(run_dir / "metrics.jsonl")
    names = list(results) + [m.get("stage") for m in metrics]
    labels = stage_labels(run_dir, [n for n in names if n])
    k = _k_of(results)
    parts = [f"# minirsi run `{run_dir.name}`", "",
             f"Mean@{k} strict success (%) of every stage on every suite; Mean is the equal-weight "
             f"mean over the suites. Retained stages first, then baselines.", "",
             results_table(results, k, labels), "",
             "## By difficulty", "",
             f"Mean@{k} (%) per difficulty, pooled over the suites (each weighted by its task count).", "",
             difficulty_table(results, labels), "",
             "## Long-horizon suite", "",
             long_table(results, labels=labels), "",
             "## What the failures were", "",
             f"Failed episodes on {(_suites(results) or ['-'])[0]} by category (minirsi/run/failures.py: format, "
             "turn limit, a wrong name, the wrong decision after an obstacle, stopped early, other).", "",
             failure_table(results, labels=labels), "",
             "## The training pool within each RPR stage", "",
             pool_table(metrics, labels), ""]
    stage_rows = []
    for done in sorted(run_dir.glob("stages/*/DONE.json")):
        rec = json.loads(done.read_text())
        ev = done.parent / "eval.json"
        ev_s = json.loads(ev.read_text()).get("wall_s") if ev.is_file() else None
        stage_rows.append(f"| {done.parent.name} | {rec.get('label', '')} | {rec.get('wall_s', 0):.0f} | "
                          f"{'-' if ev_s is None else f'{ev_s:.0f}'} |")
    if stage_rows:
        parts += ["## Stages", "", "| Directory | Stage | train s | eval s |", "|---|---|---|---|", *stage_rows, ""]
    if results:
        plot_success(results, run_dir / "success.png", labels)
        parts += ["## Plots", "", "![success per stage](success.png)", ""]
    if plot_signals(metrics, run_dir / "signals.png", labels) is not None:
        parts += ["![training signals](signals.png)", ""]
    out = run_dir / "report.md"
    out.write_text("\n".join(parts))
    return out


# ----------------------------------------------------------------------------------------------
# The reward audit
# ----------------------------------------------------------------------------------------------


def episode_files(run_dir: str | Path, include_eval: bool = False) -> list[Path]:
    """The run's stored episode files: training rollouts, and evaluation episodes if asked."""
    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("stages/*/episodes*.jsonl"))
    if include_eval:
        files += sorted(run_dir.glob("stages/*/eval/*.jsonl"))
    return files


def audit_run(run_dir: str | Path, include_eval: bool = False) -> dict[str, Any]:
    """Rescore the run's episodes under FDR and SPR with its frozen calibration.

    Returns ``{"episodes": n, "files": [...], "fdr": AuditReport-as-dict, "spr": ...}``.
    """
    from minirsi.core import fdr, reward_audit
    from minirsi.core.episode import read_jsonl

    run_dir = Path(run_dir)
    cal = run_dir / "calibration.json"
    if not cal.is_file():
        raise ValueError(f"{cal} not found: the audit rescores with the run's frozen D_f; is {run_dir} a run directory?")
    scales = fdr.load_scales(cal)
    files = episode_files(run_dir, include_eval)
    episodes = [ep for f in files for ep in read_jsonl(f)]
    episodes = [ep for ep in episodes if ep.error is None]  # a dead sandbox has no verifier result to score
    if not episodes:
        raise ValueError(f"{run_dir}: no stored episodes to audit (looked in {len(files)} files)")
    fdr_report, spr_report = reward_audit.audit_fdr_spr(episodes, scales)
    return {"episodes": len(episodes), "files": [str(f.relative_to(run_dir)) for f in files],
            "fdr": _as_dict(fdr_report), "spr": _as_dict(spr_report)}


def _as_dict(report: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(report)


def format_audit(a: Mapping[str, Any]) -> str:
    f, s = a["fdr"], a["spr"]
    rows = [
        ("failed share of reward mass", f"{100 * f['failed_share']:.2f}%", f"{100 * s['failed_share']:.2f}%",
         "50.09% / 28.72%"),
        ("failures scoring >= 1", str(f["failures_scoring_at_least_1"]), str(s["failures_scoring_at_least_1"]), "158 / 0"),
        ("failures passing every executed check", str(f["failures_all_executed_passed"]),
         str(s["failures_all_executed_passed"]), "48 / 48"),
    ]
    lines = [f"Reward audit over {a['episodes']} episodes ({len(a['files'])} files)", "",
             "| figure | FDR | SPR | paper (FDR / SPR, 4,352 runs) |", "|---|---|---|---|"]
    lines += [f"| {name} | {x} | {y} | {p} |" for name, x, y, p in rows]
    return "\n".join(lines)


def cli(argv: Sequence[str] | None = None, command: str = "report") -> int:
    if command not in ("report", "audit"):
        raise ValueError(f"report.cli serves 'report' and 'audit', not {command!r}")
    p = argparse.ArgumentParser(prog=f"minirsi {command}",
                                description="Write RUN_DIR/report.md and plots." if command == "report"
                                else "Rescore a run's stored episodes under FDR and SPR.")
    p.add_argument("run_dir", help="a run directory written by `minirsi run`")
    if command == "audit":
        p.add_argument("--eval", action="store_true", help="also audit the evaluation episodes")
        p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    try:
        if command == "report":
            path = write_report(args.run_dir)
            print(path.read_text())
            print(f"\nwritten: {path}")
            return 0
        a = audit_run(args.run_dir, include_eval=args.eval)
    except ValueError as e:
        print(f"minirsi {command}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(a, indent=2) if args.json else format_audit(a))
    return 0
