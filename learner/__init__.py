"""The learner package. Its pure SAO modules take tensors in and give tensors out (no I/O, no
database, no HTTP):

- ``learner.algo.dis``: DIS, direct double-sided importance sampling loss (SAO §2.2, docs/design.md
  §5.1).
- ``learner.algo.gae``: skip-observation token-level GAE, length-adaptive λ, step-level ablation
  (SAO §2.4 and appendix A.1, docs/design.md §5.3).
- ``learner.algo.critic``: the value model with frozen attention (SAO §2.3, docs/design.md §5.2).
- ``learner.data.batch``: the padded batch of trajectories and the policy's log-probabilities of
  its tokens (shared by the SAO and SPO++ steps).
- ``learner.algo.kl``: the k3 estimator, and the optional KL anchor to the base policy (not in SAO).
- ``learner.algo.metrics``: masked mean, value loss, explained variance, step throughput.
- ``learner.guard.gate``: the gate a candidate version passes on the probe set before it serves
  (docs/design.md §9.1).
- ``learner.algo.sao``: one SAO step on in-memory models (critic, advantages; the running-mean
  baseline in place of the critic).
- ``learner.algo.policy_update``: SAO's policy update, DIS or MIS with an old policy.
- ``learner.algo.pretrain``: value pretraining.
- ``learner.algo.spo``: the SPO++ update.
- ``learner.config``: the typed, validated config of a learner run (algorithm, optimiser,
  correction, presets).
- ``learner.algo.algorithm``: the contract every algorithm implements; ``learner.algo.registry``: which
  class runs each algorithm; ``learner.models.optim``: AdamW and the clipped step.
"""
