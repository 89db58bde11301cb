"""The guard in the learner: the gate a candidate version passes on the probe set before it
serves (``gate``, its settings in ``gate_config``, its reference models in ``gate_models``, the
probe set in ``probes.json``); the verdict on the lineage on probation (``guard``, its settings in
``guard_config``, who votes in ``guard_votes``); and a rollback, an earlier version's weights
published as a new version (``rollback``)."""
