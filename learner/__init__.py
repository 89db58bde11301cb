"""The learner package: the loop at the top, its parts in four sub-packages.

- ``learner.algo``: the algorithms. Its pure SAO modules take tensors in and give tensors out (no
  I/O, no database, no HTTP): ``dis``, DIS, direct double-sided importance sampling loss (SAO
  §2.2, docs/design.md §5.1); ``gae``, skip-observation token-level GAE, length-adaptive λ,
  step-level ablation (SAO §2.4 and appendix A.1, docs/design.md §5.3); ``critic``, the value
  model with frozen attention (SAO §2.3, docs/design.md §5.2); ``kl``, the k3 estimator, and the
  optional KL anchor to the base policy (not in SAO); ``metrics``, masked mean, value loss,
  explained variance, step throughput. The steps: ``sao``, one SAO step on in-memory models
  (critic, advantages; the running-mean baseline in place of the critic); ``policy_update``,
  SAO's policy update, DIS or MIS with an old policy; ``pretrain``, value pretraining; ``spo``,
  the SPO++ update. ``algorithm``: the contract every algorithm implements; ``registry``: which
  class runs each algorithm.
- ``learner.models``: where the models live and how they run (placement, device, precision,
  LoRA); ``learner.models.optim``: AdamW and the clipped step.
- ``learner.data``: from the logged records to a batch (the joiner, samples, the identity cap);
  ``learner.data.batch``: the padded batch of trajectories and the policy's log-probabilities of
  its tokens (shared by the SAO and SPO++ steps).
- ``learner.guard``: the gate a candidate version passes on the probe set before it serves
  (``learner.guard.gate``, docs/design.md §9.1), the guard's verdict on probation, rollbacks.

At the top: ``learner.process`` (``saoserve learn``: join, train, publish) and
``learner.distributed`` (the same over N ranks); ``learner.config``: the typed, validated config
of a learner run (algorithm, optimiser, correction, presets); ``learner.publish``,
``learner.resume``, ``learner.step_plan`` and ``learner.faults``.
"""
