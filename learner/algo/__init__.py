"""The learning algorithms: the SAO and SPO++ formulas (``dis``, ``gae``, ``critic``,
``advantages``, ``kl``, ``offpolicy``, ``mis``, ``finite``, ``baselines``, ``metrics``,
``prefix``: tensors in, tensors out) and the steps built from them (``sao``, ``spo``,
``policy_update``, ``old_logits``, ``pretrain``), behind one contract (``algorithm``) and one
table of which class runs each algorithm (``registry``)."""
