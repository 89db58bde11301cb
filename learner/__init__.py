"""The learner package. Its pure SAO modules take tensors in and give tensors out (no I/O, no
database, no HTTP):

- ``learner.dis``: DIS, direct double-sided importance sampling loss (SAO §2.2, DESIGN §5.1).
- ``learner.gae``: skip-observation token-level GAE, length-adaptive λ, step-level ablation
  (SAO §2.4 and appendix A.1, DESIGN §5.3).
- ``learner.critic``: the value model with frozen attention (SAO §2.3, DESIGN §5.2).
- ``learner.batch``: the padded batch of trajectories and the policy's log-probabilities of
  its tokens (shared by the SAO and SPO++ steps).
- ``learner.kl``: the optional KL anchor to the base policy (not in SAO; k3 estimator).
- ``learner.sao``: one SAO step on in-memory models, value pretraining, running-mean baseline.
- ``learner.spo``: the SPO++ update.
- ``learner.config``: the typed config of a learner run (algorithm, correction, presets).
- ``learner.algorithm``: the contract every algorithm implements, the shared optimiser step.
"""
