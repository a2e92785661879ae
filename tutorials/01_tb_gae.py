"""Tutorial 1: credit assignment with TB-GAE.            (module: minirsi/core/tb_gae.py)

Run:  python tutorials/01_tb_gae.py

A terminal episode is a long token sequence in which only some tokens were chosen by the
policy (the actions); the rest are the prompt and the shell's output (observations). Standard
GAE decays credit per *token*, so a verbose `ls -R` between two decisions weakens the link
between them. TB-GAE (docs/method.md section 4) decays credit only when the *turn* changes and
skips observation tokens altogether. This script builds one tiny episode by hand and shows:

  1. the advantages TB-GAE gives, next to the loop that defines it (``tb_gae_reference``) and
     the plain vectorised form (``tb_gae_plain``; training runs the CPU-tuned ``tb_gae_fast``);
  2. that padding the observation with 1,000 extra tokens changes nothing at action tokens;
  3. that crossing B turn boundaries attenuates credit by (gamma_turn * lam_turn) ** B;
  4. that with one action token per turn and no observations it is ordinary GAE.
"""

import torch

from minirsi.core.tb_gae import tb_gae, tb_gae_plain, tb_gae_reference

gamma_turn, lam_turn = 0.9, 0.8

# One episode, read left to right:  P P | a a | o o o | a a a | o | a     (P prompt, a action,
# o observation). Three turns: actions of turn 0, 1, 2. Reward 1 on the last action token.
kinds = "PPaaoooaaaoa"
turn = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
action_mask = torch.tensor([[k == "a" for k in kinds]], dtype=torch.float64)
turn_ids = torch.tensor([turn])
rewards = torch.zeros(1, len(kinds), dtype=torch.float64)
rewards[0, -1] = 1.0
values = torch.zeros_like(rewards)  # a critic that knows nothing yet: A_t is pure credit

adv, ret = tb_gae(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)  # impl="fast"
ref, _ = tb_gae_reference(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
plain, _ = tb_gae_plain(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
print("1. token kinds :", " ".join(kinds))
print("   advantages  :", " ".join(f"{a:.2f}" for a in adv[0].tolist()))
same_forms = torch.allclose(adv, ref) and torch.allclose(plain, ref)
print("   fast, plain and loop forms agree:", same_forms)
assert same_forms
# With V = 0: turn-2 action gets 1; turn-1 actions get g*l*1 = 0.72; turn-0 actions 0.72**2.
assert abs(adv[0, 2].item() - (gamma_turn * lam_turn) ** 2) < 1e-12

# 2. A much longer observation between turn 0 and turn 1 changes nothing at action tokens.
long_kinds = kinds[:4] + "o" * 1000 + kinds[4:]
long_turn = turn[:4] + [1] * 1000 + turn[4:]
mask2 = torch.tensor([[k == "a" for k in long_kinds]], dtype=torch.float64)
r2 = torch.zeros(1, len(long_kinds), dtype=torch.float64)
r2[0, -1] = 1.0
adv2, _ = tb_gae(r2, torch.zeros_like(r2), mask2, torch.tensor([long_turn]), gamma_turn, lam_turn)
same = torch.equal(adv2[mask2.bool()], adv[action_mask.bool()])
print("2. advantages at actions unchanged by 1,000 more observation tokens:", same)
assert same

# 3. Attenuation per boundary: credit at turn k is (g*l)**(2 - k) of the final reward.
for k, pos in ((0, 2), (1, 7), (2, 11)):
    print(f"3. turn {k}: A = {adv[0, pos].item():.4f} = (g*l)^{2 - k}")
    assert abs(adv[0, pos].item() - (gamma_turn * lam_turn) ** (2 - k)) < 1e-12

# 4. One action token per turn, no observations: TB-GAE is GAE(gamma, lambda).
T = 6
r = torch.randn(1, T, dtype=torch.float64)
v = torch.randn(1, T, dtype=torch.float64)
a_tb, _ = tb_gae(r, v, torch.ones(1, T), torch.arange(T)[None], gamma_turn, lam_turn)
gae, last = torch.zeros(T, dtype=torch.float64), 0.0
for t in reversed(range(T)):  # the textbook recurrence
    next_v = v[0, t + 1] if t + 1 < T else 0.0
    delta = r[0, t] + gamma_turn * next_v - v[0, t]
    last = delta + gamma_turn * lam_turn * last
    gae[t] = last
print("4. equals standard GAE:", torch.allclose(a_tb[0], gae))
assert torch.allclose(a_tb[0], gae)
