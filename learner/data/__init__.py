"""The learner's data path, from the logged records to the batch a step trains on:
``joiner`` joins trajectories with feedback (its pure rules in ``join_plan``); ``samples`` makes
learner samples and padded batches of them (``batch``: the batch and the policy's log-probabilities
of its tokens); ``sample_queue`` hands the trainer its next batch, through the identity cap
(``identity_cap``)."""
