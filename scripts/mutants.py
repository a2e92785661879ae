"""Mutation testing: plant one-line bugs, one at a time, and check that the tests catch each.

    python3 scripts/mutants.py                 # every mutant, 2 at a time: ~10 min on 2 cores
    python3 scripts/mutants.py --list          # the mutants, their areas and tests
    python3 scripts/mutants.py tb_gae fdr      # the mutants of some areas (or ids)
    python3 scripts/mutants.py --baseline ...  # first run each mutant's tests unmutated (must pass)

Each mutant is an exact one-line replacement in one file of minirsi/ (``old`` must occur there
exactly once) and the tests that should catch it (pytest arguments, run with ``-x``: the first
failure kills the mutant). The tree is copied to a temporary directory once per worker (the files
git tracks or would track); a mutant is written into the copy, its tests run there with
PYTHONPATH pointing at the copy, and the file is restored. The working tree is never written.
Hypothesis runs with a fixed seed (``--hypothesis-seed=0``), no example database and no shrinking,
so a run is repeatable. The last lines print the kill rate per area and overall and list the survivors; the
exit status is 1 if a mutant of tb_gae, fdr, spr or the verifier's success rule survives
without being listed in ``EQUIVALENT`` (README, "Mutation testing").

Why a curated list and not mutmut: mutmut generates every operator swap of these files
(thousands of mutants across tb_gae_fast.py, verifier.py and rpr.py, most of them in input
checks and error messages) and each needs a test run of 5-60 s: hours, not the 10 minutes this
has on CI's 2 cores. The bugs below are the ones a reader could write while implementing
docs/method.md (a swapped lambda, a reward clipped, a gate that ignores an exit status, a
critic read one token late, a jail without its network namespace), each aimed at the rule it
breaks, and the list includes every bug issue 28 found surviving the suite. The cost: a bug
nobody listed is not tried. Add a line to MUTANTS when a new rule is written.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    id: str
    """``area.name``; the area is the part of the method the bug breaks."""
    file: str
    """Path under the repository root."""
    old: str
    """Text that occurs exactly once in ``file``."""
    new: str
    """Its replacement: the bug."""
    tests: tuple[str, ...]
    """pytest arguments that should catch it."""

    @property
    def area(self) -> str:
        return self.id.split(".")[0]


TB = "minirsi/core/tb_gae.py"
FAST = "minirsi/core/tb_gae_fast.py"
HAND = ("tests/test_tb_gae.py", "-k", "hand_worked or standard_gae or attenuation or matches_per_token_loop")
MUTANTS = [
    # --- TB-GAE, the loop reference (tests/test_tb_gae.py: hand-worked cases, then properties)
    Mutant("tb_gae.ref_no_lambda_at_boundary", TB,
           "decay = torch.where(same_turn, 1.0, gamma_turn * lam_turn * boundary.double())",
           "decay = torch.where(same_turn, 1.0, gamma_turn * boundary.double())", HAND),
    Mutant("tb_gae.ref_lambda_inside_turn", TB,
           "decay = torch.where(same_turn, 1.0, gamma_turn * lam_turn * boundary.double())",
           "decay = torch.where(same_turn, lam_turn, gamma_turn * lam_turn * boundary.double())", HAND),
    Mutant("tb_gae.ref_no_gamma_on_V_n", TB,
           "discount = torch.where(same_turn, 1.0, gamma_turn * boundary.double())",
           "discount = torch.where(same_turn, 1.0, boundary.double())", HAND),
    Mutant("tb_gae.ref_returns_are_advantages", TB,
           "R[:, t] = torch.where(act, A_t + V[:, t], 0.0)", "R[:, t] = torch.where(act, A_t, 0.0)", HAND),
    Mutant("tb_gae.ref_observations_reset_the_carry", TB,
           "V_n = torch.where(act, V[:, t], V_n)", "V_n = torch.where(act, V[:, t], 0.0)", HAND),
    # --- TB-GAE, the plain closed form
    Mutant("tb_gae.plain_l_for_one_minus_l", TB,
           "X[:, j] = (gamma_turn * (1 - lam_turn) * V_first[:, j + 1]",
           "X[:, j] = (gamma_turn * lam_turn * V_first[:, j + 1]", HAND),
    Mutant("tb_gae.plain_drops_later_turn_rewards", TB,
           "returns = rewards_to_end - later_turns.gather(1, slot) + X.gather(1, slot)",
           "returns = rewards_to_end + X.gather(1, slot)", HAND),
    # --- TB-GAE, the fast path training runs
    Mutant("tb_gae.fast_l_for_one_minus_l", FAST,  # issue 28: the hand-worked cases had l = 0.5
           "gamma_turn * (1 - lam_turn) * V_first + gamma_turn * lam_turn * turn_reward",
           "gamma_turn * lam_turn * V_first + gamma_turn * lam_turn * turn_reward", HAND),
    Mutant("tb_gae.fast_no_gamma_in_decay", FAST,
           "c = torch.full_like(a, gamma_turn * lam_turn)", "c = torch.full_like(a, lam_turn)", HAND),
    Mutant("tb_gae.fast_continuation_off_by_one_turn", FAST,
           "X[:, :-1] = Z[:, 1:]  # X_k = Z_{k+1}", "X[:, :-1] = Z[:, :-1]", HAND),
    Mutant("tb_gae.fast_scan_does_not_compose_decays", FAST,
           "c[:, :-d] = c[:, :-d] * c[:, d:]", "c[:, :-d] = c[:, :-d]", HAND),
    Mutant("tb_gae.fast_advantage_plus_value", FAST,
           "advantages = torch.addcmul(returns, values, action, value=-1.0, out=action)",
           "advantages = torch.addcmul(returns, values, action, value=1.0, out=action)", HAND),
    Mutant("tb_gae.fast_broadcast_reads_wrong_block", FAST,
           "value = per_block.gather(1, (chunks.top - offset).long())  # (B, nC)",
           "value = per_block.gather(1, (chunks.top - offset).long().clamp(max=0))  # (B, nC)",
           ("tests/test_tb_gae.py", "-k", "hand_worked or broadcast or long_rows or chunked_prefix")),
    Mutant("tb_gae.fast_missed_decrease_across_chunk_edge", FAST,
           "if _any(first[:, 1:] < top[:, :-1]):", "if False:",
           ("tests/test_tb_gae.py", "-k", "chunk_layout or chunked_prefix or decreasing")),
    Mutant("tb_gae.token_gae_ablation_is_tb_gae", "minirsi/core/rpr.py",
           "steps = batch[\"action_mask\"].long().cumsum(1)  # (B, T), non-decreasing",
           "steps = batch[\"turn_ids\"]", ("tests/test_rpr.py", "-k", "token_gae")),
    # --- FDR
    Mutant("fdr.clipped", "minirsi/core/fdr.py",
           "return P / scale_for(family, scales)", "return min(P / scale_for(family, scales), 1.0)",
           ("tests/test_rewards.py",)),
    Mutant("fdr.over_C_not_D", "minirsi/core/fdr.py",
           "return P / scale_for(family, scales)",
           "return P / (total if total else scale_for(family, scales))", ("tests/test_rewards.py",)),
    Mutant("fdr.quantile_without_interpolation", "minirsi/core/fdr.py",
           "return s[lo] + (pos - lo) * (s[hi] - s[lo])", "return s[lo]", ("tests/test_rewards.py",)),
    Mutant("fdr.quantile_position_n_not_n_minus_1", "minirsi/core/fdr.py",
           "pos = q * (len(s) - 1)", "pos = min(q * len(s), len(s) - 1)", ("tests/test_rewards.py",)),
    Mutant("fdr.empty_family_gets_1", "minirsi/core/fdr.py",
           "D_f[family] = float(fallback)", "D_f[family] = 1.0", ("tests/test_rewards.py",)),
    Mutant("fdr.unlisted_family_ignores_the_runs_fallback", "minirsi/core/fdr.py",
           "fallback = getattr(scales, \"fallback\", DEFAULT_FALLBACK)", "fallback = DEFAULT_FALLBACK",
           ("tests/test_rewards.py",)),
    # --- SPR
    Mutant("spr.no_success_term", "minirsi/core/spr.py",
           "return float(bool(success)) + P / (P + D_prime)", "return P / (P + D_prime)",
           ("tests/test_rewards.py",)),
    Mutant("spr.dense_term_is_fdr", "minirsi/core/spr.py",
           "return float(bool(success)) + P / (P + D_prime)", "return float(bool(success)) + P / D_prime",
           ("tests/test_rewards.py",)),
    Mutant("spr.ignores_D_prime", "minirsi/core/spr.py",
           "D_prime = scale_for(family, scales if scales_prime is None else scales_prime)",
           "D_prime = scale_for(family, scales)", ("tests/test_rewards.py",)),
    Mutant("spr.success_is_truthy_P", "minirsi/core/spr.py",
           "return float(bool(success)) + P / (P + D_prime)", "return float(bool(P)) + P / (P + D_prime)",
           ("tests/test_rewards.py",)),
    # --- the verifier's success rule (S)
    Mutant("verifier.tb1_ignores_exit_status", "minirsi/env/verifier.py",  # issue 28: 20 passed before
           "success = run.exit_code == 0 and bool(checks) and all(o == \"passed\" for o in checks.values())",
           "success = bool(checks) and all(o == \"passed\" for o in checks.values())",
           ("tests/test_verifier.py", "-k", "tb1")),
    Mutant("verifier.tb1_any_check_passed", "minirsi/env/verifier.py",
           "success = run.exit_code == 0 and bool(checks) and all(o == \"passed\" for o in checks.values())",
           "success = run.exit_code == 0 and bool(checks) and any(o == \"passed\" for o in checks.values())",
           ("tests/test_verifier.py", "-k", "tb1")),
    Mutant("verifier.tb1_no_checks_is_success", "minirsi/env/verifier.py",
           "success = run.exit_code == 0 and bool(checks) and all(o == \"passed\" for o in checks.values())",
           "success = run.exit_code == 0 and all(o == \"passed\" for o in checks.values())",
           ("tests/test_verifier.py", "-k", "tb1")),
    Mutant("verifier.reward_above_zero_counts", "minirsi/env/verifier.py",
           "return float(text) == 1.0, None", "return float(text) > 0, None", ("tests/test_verifier.py",)),
    Mutant("verifier.timeout_keeps_the_reward", "minirsi/env/verifier.py",
           "    if run.timed_out:\n        success = False\n", "    if run.timed_out:\n        pass\n",
           ("tests/test_verifier.py", "-k", "timeout")),
    Mutant("verifier.reward_json_ignored", "minirsi/env/verifier.py",
           "success, reward_error = _read_reward(raw if raw is not None or \"reward.json\" not in run.files",
           "success, reward_error = _read_reward(raw if True", ("tests/test_verifier.py", "-k", "reward_json")),
    Mutant("verifier.hygiene_counted", "minirsi/env/verifier.py",
           "counted = {name: outcome for name, outcome in checks.items() if name not in hygiene}",
           "counted = dict(checks)", ("tests/test_verifier.py",)),
    Mutant("verifier.unrun_checks_not_counted", "minirsi/env/verifier.py",
           "            checks[name] = \"error\"  # declared but never ran: still one of the C checks\n",
           "            continue\n", ("tests/test_verifier.py",)),
    # --- the sandbox's isolation
    Mutant("sandbox.network_shared", "minirsi/env/sandbox/bwrap.py",  # issue 28: test_sandbox.py alone passes
           "\"--unshare-pid\", \"--unshare-net\", ", "\"--unshare-pid\", ",
           ("tests/test_hostile.py", "-k", "no_network")),
    Mutant("sandbox.host_pids_visible", "minirsi/env/sandbox/bwrap.py",
           "\"--unshare-user\", \"--unshare-pid\", ", "\"--unshare-user\", ",
           ("tests/test_hostile.py", "-k", "killing_the_harness or next_episode or fork_bomb_is")),
    Mutant("sandbox.root_writable", "minirsi/env/sandbox/bwrap.py",
           "args += [\"--remount-ro\", \"/\"]", "args += []",
           ("tests/test_hostile.py", "-k", "writes_outside")),
    Mutant("sandbox.host_environment_leaks", "minirsi/env/sandbox/bwrap.py",
           "\"--hostname\", \"sandbox\", \"--clearenv\"]", "\"--hostname\", \"sandbox\"]",
           ("tests/test_sandbox.py", "-k", "environment")),
    Mutant("sandbox.no_final_sweep", "minirsi/env/sandbox/bwrap.py",
           "        if not self._as_root:\n            return\n        # A killed process",
           "        if True:\n            return\n        # A killed process",
           ("tests/test_sandbox.py", "tests/test_hostile.py", "-k", "outlives_close or daemons or fork_bomb_is")),
    # --- the PPO update
    Mutant("ppo.surrogate_max_not_min", "minirsi/core/rpr.py",
           "surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)",
           "surrogate = torch.maximum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)",
           ("tests/test_rpr.py", "-k", "policy_loss")),
    Mutant("ppo.ratio_inverted", "minirsi/core/rpr.py",
           "log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))",
           "log_ratio = torch.where(m, old_logprobs - logprobs, torch.zeros_like(logprobs))",
           ("tests/test_rpr.py", "-k", "policy_loss or direction")),
    Mutant("ppo.loss_sign", "minirsi/core/rpr.py",
           "loss = -masked_mean(surrogate, m, normalizer)", "loss = masked_mean(surrogate, m, normalizer)",
           ("tests/test_rpr.py", "-k", "policy_loss or direction")),
    Mutant("ppo.actor_lr_zero", "minirsi/core/rpr.py",  # issue 28: "no learning at all"
           "return Optimizers(torch.optim.AdamW(params, lr=cfg.lr_actor, weight_decay=0.0),",
           "return Optimizers(torch.optim.AdamW(params, lr=0.0, weight_decay=0.0),",
           ("tests/test_rpr.py", "tests/test_learning.py", "-k", "changes_actor or one_token_bandit and 0")),
    Mutant("ppo.calibration_moves_the_actor", "minirsi/core/rpr.py",
           "stopped = not update_actor  # target_kl reached: the actor is only read from then on",
           "stopped = False", ("tests/test_rpr.py", "-k", "calibration")),
    Mutant("ppo.returns_are_advantages", "minirsi/core/rpr.py",
           "    batch[\"returns\"] = returns\n", "    batch[\"returns\"] = advantages\n",
           ("tests/test_learning.py", "-k", "critic_baseline and 0")),
    Mutant("ppo.kl_estimate_reversed", "minirsi/core/rpr.py",
           "d = torch.where(m, ref_logprobs - logprobs, torch.zeros_like(logprobs))  # (B, T)",
           "d = torch.where(m, logprobs - ref_logprobs, torch.zeros_like(logprobs))  # (B, T)",
           ("tests/test_rpr.py", "-k", "kl")),
    # --- the critic
    Mutant("critic.returns_zero", "minirsi/core/critic.py",  # issue 28: both probes passed with V = 0
           "return torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1)  # (B, T)",
           "return torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1) * 0  # (B, T)",
           ("tests/test_learning.py", "-k", "critic_baseline and 0")),
    Mutant("critic.reads_the_value_after_its_token", "minirsi/core/critic.py",
           "v = self.head(h[:, :-1].to(self.head.weight.dtype)).squeeze(-1).float()",
           "v = self.head(h[:, 1:].to(self.head.weight.dtype)).squeeze(-1).float()",
           ("tests/test_critic.py", "tests/test_learning.py", "-k", "never_sees or one_token_bandit and 0")),
    Mutant("critic.value_clip_takes_the_min", "minirsi/core/critic.py",
           "err = torch.maximum(err, (v_clip - returns) ** 2)", "err = torch.minimum(err, (v_clip - returns) ** 2)",
           ("tests/test_critic.py",)),
    Mutant("critic.frozen_with_a_frozen_actor", "minirsi/core/critic.py",
           "return critic.requires_grad_(True)  # a copy of a frozen actor carries its flags: drop them",
           "return critic", ("tests/test_critic.py",)),
    Mutant("critic.warmup_never_steps", "minirsi/core/critic.py",
           "            optimizer.step()\n            logger.info(\"critic warm-up",
           "            logger.info(\"critic warm-up", ("tests/test_critic.py",)),
    Mutant("critic.warmup_regresses_on_rewards_only", "minirsi/core/critic.py",
           "value_loss(v, b[\"old_values\"], b[\"returns\"], b[\"action_mask\"], cfg.value_clip, n_tok).backward()",
           "value_loss(v, b[\"old_values\"], b[\"rewards\"], b[\"action_mask\"], cfg.value_clip, n_tok).backward()",
           ("tests/test_critic.py", "tests/test_learning.py", "-k", "warmup or inherited")),
]

MUST_BE_ZERO = ("tb_gae", "fdr", "spr", "verifier")
"""Areas whose survivors fail this script unless listed in EQUIVALENT (issue 28)."""

EQUIVALENT: dict[str, str] = {}
"""Mutant id -> why it cannot change any result (README, "Mutation testing"). Empty: none of the
mutants above is equivalent."""


def copy_tree(dst: Path) -> None:
    """The files git tracks or would track (not ignored) under ROOT, into ``dst``."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            target = dst / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


PRELOAD = ("torch", "numpy", "safetensors.torch", "transformers", "hypothesis", "pytest", "peft",
           "transformers.models.qwen3.modeling_qwen3")
"""Imported once by this process before it forks a child per mutant: the ~7 s of CPU that
importing them costs is paid once, not 50 times. minirsi itself is never imported here, so each
child imports the mutated copy."""


def start_tests(tree: Path, args: tuple[str, ...], log: Path) -> int:
    """Fork a child that runs pytest ``args`` in ``tree`` (output to ``log``); its pid.

    The parent is single-threaded when it forks (no lock can be held by another thread)."""
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: never returns
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(tree)
        os.environ["PYTHONPATH"] = str(tree)  # for the subprocesses tests start (CLI runs)
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        sys.dont_write_bytecode = True
        sys.path.insert(0, str(tree))
        import pytest
        from hypothesis import Phase, settings

        # No shrinking (the first failing example kills the mutant; shrinking it through the
        # per-token loop reference took most of a TB-GAE mutant's minute) and no example database.
        settings.register_profile("mutants", phases=[Phase.explicit, Phase.generate], database=None)
        code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0",
                            "--hypothesis-profile=mutants", "-o", "addopts=", *args])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    except BaseException:  # noqa: BLE001  (anything: report it as the child's failure)
        import traceback

        traceback.print_exc()
        os._exit(70)


def outcome(code: int) -> str:
    """pytest's exit status -> "passed" | "no tests" (5: a selection that matched nothing) | "failed"."""
    return {0: "passed", 5: "no tests"}.get(code, "failed")


def check_mutant(tree: Path, m: Mutant) -> str:
    """The mutated text of ``m.file`` (raises if ``old`` does not occur exactly once)."""
    text = (tree / m.file).read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutant {m.id}: its text occurs {n} times in {m.file} (must be once); update MUTANTS")
    return text.replace(m.old, m.new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("select", nargs="*", help="areas or mutant ids (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run at once, each in its own copy (default 2)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per mutant's tests (a hang counts as killed)")
    ap.add_argument("--baseline", action="store_true", help="first run each mutant's tests on the unmutated copy")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.select or m.area in args.select or m.id in args.select]
    if not chosen:
        ap.error(f"nothing matches {args.select}; areas: {sorted({m.area for m in MUTANTS})}")
    if args.list:
        for m in chosen:
            print(f"{m.id:50s} {m.file:28s} {' '.join(m.tests)}")
        return 0
    for name in PRELOAD:
        importlib.import_module(name)
    with tempfile.TemporaryDirectory(prefix="minirsi-mutants-") as tmp:
        os.chmod(tmp, 0o755)  # the sandboxes' unprivileged uid reads task fixtures (a TB1 solution.sh) here
        free = []
        for j in range(max(1, args.jobs)):
            tree = Path(tmp) / f"tree{j}"
            copy_tree(tree)
            free.append(tree)
        where = subprocess.run([sys.executable, "-c", "import minirsi; print(minirsi.__file__)"], cwd=free[0],
                               env={**os.environ, "PYTHONPATH": str(free[0])}, capture_output=True, text=True)
        if not where.stdout.startswith(str(free[0])):
            raise SystemExit(f"the copy's minirsi is not the one imported: {where.stdout or where.stderr}")
        for m in chosen:
            check_mutant(free[0], m)  # every mutant applies, before any test runs
        # With --baseline every mutant's tests first run unmutated; mutants start once all have.
        # The training probes' (tens of seconds each) go first, so that the short ones fill in.
        chosen.sort(key=lambda m: "tests/test_learning.py" not in m.tests)
        todo = [(m, "baseline") for m in chosen] if args.baseline else [(m, "mutant") for m in chosen]
        later = [(m, "mutant") for m in chosen] if args.baseline else []
        running: dict[int, tuple] = {}  # pid -> (mutant, phase, tree, original text, start, log)
        results, t0 = [], time.monotonic()
        while todo or running or later:
            if not todo and not running:
                todo, later = later, []
            while todo and free:
                m, phase = todo.pop(0)
                tree = free.pop()
                original = (tree / m.file).read_text()
                if phase == "mutant":
                    (tree / m.file).write_text(check_mutant(tree, m))
                log = tree.parent / f"{tree.name}.log"
                running[start_tests(tree, m.tests, log)] = (m, phase, tree, original, time.monotonic(), log)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                for pid, (m, phase, tree, original, started, log) in list(running.items()):
                    if time.monotonic() - started > args.timeout:
                        os.kill(pid, signal.SIGKILL)  # reaped below as a kill; its tests' children die with their groups
                time.sleep(0.2)
                continue
            m, phase, tree, original, started, log = running.pop(pid)
            seconds = time.monotonic() - started
            (tree / m.file).write_text(original)
            free.append(tree)
            if os.WIFSIGNALED(status):
                result = "timeout"
            else:
                result = outcome(os.WEXITSTATUS(status))
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            if phase == "baseline":
                if result != "passed":
                    results.append((m, f"baseline {result}"))
                    print(f"{'baseline ' + result:17s} {seconds:6.1f} s  {m.id}  [{tail}]", flush=True)
                    later = [(x, p) for x, p in later if x is not m]
                continue
            result = {"failed": "killed", "timeout": "killed (timeout)", "passed": "SURVIVED"}.get(result, result)
            results.append((m, result))
            caught = next((line.split(" - ")[0][7:] for line in log.read_text(errors="replace").splitlines()
                           if line.startswith("FAILED ")), "")
            note = f"  by {caught}" if result.startswith("killed") and caught else ""
            note = f"  [{tail}]" if not result.startswith("killed") else note
            print(f"{result:17s} {seconds:6.1f} s  {m.id}{note}", flush=True)
    print(f"\n{len(results)} mutants in {(time.monotonic() - t0) / 60:.1f} min")
    areas = sorted({m.area for m, _ in results}, key=[m.area for m in MUTANTS].index)
    for area in areas:
        mine = [r for m, r in results if m.area == area]
        killed = sum(r.startswith("killed") for r in mine)
        print(f"  {area:10s} {killed}/{len(mine)} killed")
    killed = sum(r.startswith("killed") for _, r in results)
    print(f"kill rate: {killed}/{len(results)} = {100 * killed / len(results):.0f}%")
    bad = False
    for m, r in results:
        if not r.startswith("killed"):
            why = EQUIVALENT.get(m.id)
            print(f"  survivor: {m.id} ({r})" + (f": equivalent, {why}" if why else ""))
            bad |= m.area in MUST_BE_ZERO and why is None or not r.startswith(("killed", "SURVIVED"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
