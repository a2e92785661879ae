"""Tutorial 6: why the critic's V_t must be the value *before* token t.
(modules: minirsi/core/critic.py, minirsi/run/probes.py, minirsi/core/rpr.py, minirsi/core/tb_gae.py)

Run:  python tutorials/06_value_alignment.py        (about 10 seconds on a laptop CPU)

The actor scores token x_t with the logits at position t-1: log pi(x_t | x_<t). A causal value
model run over the same sequence has, at position t, a hidden state that has already read x_t.
Reading V_t there gives Q(s_t, x_t), the value *after* the choice, and for the last (or only)
decisive token the advantage becomes

    A_t = r - Q(s_t, x_t)  ~  0     (a good critic already knows whether x_t was a good pick)

so the better the critic fits, the less signal PPO gets. Read at position t-1 instead (what
``ValueModel`` does), V_t = V(s_t) cannot know x_t, and A_t = r - V(s_t) is +0.9 for a rewarded
pick and -0.1 for another when the success rate is 0.1.

The probe is the one-token bandit (minirsi/run/probes.py): a fixed prompt, one sampled token,
reward 1 iff it is one of 30 chosen ids out of 300. Both runs below share everything (model,
seed, PPO settings, the real sampler -> prepare_batch -> TB-GAE -> ppo_update path) except the
position the critic reads its value at.
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from minirsi.core.critic import ValueModel, build_critic
from minirsi.core.rpr import RPRConfig
from minirsi.run.probes import bandit

torch.set_num_threads(1)


class AfterTheTokenCritic(ValueModel):
    """The bug, for comparison: V_t = head(h_t), a value that has seen x_t."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return self.head(h).squeeze(-1).float()  # (B, T)


def tiny_model(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, tie_word_embeddings=True))


curves = {}
for name in ("before the token (V_t = head(h_{t-1}))", "after the token  (V_t = head(h_t))"):
    actor = tiny_model(seed=0)
    critic = build_critic(actor)
    if name.startswith("after"):
        critic = AfterTheTokenCritic(critic.backbone, critic.head.in_features)
    cfg = RPRConfig(lr_actor=1e-3, lr_critic=1e-3, gamma_turn=1.0, lam_turn=0.95, seed=0)
    curves[name] = bandit(actor, critic, cfg, steps=40, episodes_per_step=64, calibration=3, seed=0)

print("P(rewarded token) every 5 PPO steps (chance: 0.10)")
for name, curve in curves.items():
    print(f"  critic reads {name}: " + " ".join(f"{p:.2f}" for p in curve[::5]) + f"  final {curve[-1]:.2f}")

aligned, misaligned = curves.values()
assert all(0 <= p <= 1 for curve in curves.values() for p in curve)
assert aligned[-1] >= 0.9, "with V before the token, PPO solves the bandit"
assert misaligned[-1] < 0.5, "with V after the token, the advantage cancels and PPO stalls"
print("Only the critic's reading position differs; the aligned critic lets PPO learn the bandit.")
