"""Which class runs each algorithm: an explicit table from config model to ``Algorithm``.

``learner.process`` builds its learner with ``build_algorithm``; a reader (or a tool) follows the
table to the class. A new algorithm adds its config model (``learner.config``) and a row here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from learner.algo.algorithm import Algorithm
from learner.algo.sao import SAOLearner
from learner.algo.spo import SPOLearner
from learner.config import LearnerConfig, RunningMeanAlgorithm, SAOAlgorithm, SPOAlgorithm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.models.placement import Placement

ALGORITHMS: dict[type, type[Algorithm]] = {
    SAOAlgorithm: SAOLearner,
    RunningMeanAlgorithm: SAOLearner,  # SAO with the critic replaced by the SAO §3.4 baseline
    SPOAlgorithm: SPOLearner,
}
"""Config model of ``LearnerConfig.algorithm`` → the class that runs it."""


def build_algorithm(
    config: LearnerConfig, load_policy: Callable[[], PreTrainedModel], placement: Placement | None = None
) -> Algorithm:
    """The learner ``config`` names, built by its class's ``build`` (which loads the models with
    ``load_policy``, a fresh float32 base policy per call) on ``placement`` (None: one process on
    ``config.device``). Raises ``learner.models.device.DeviceError`` when that device is not here;
    nothing else of its own: the config was validated when it was made."""
    return ALGORITHMS[type(config.algorithm)].build(config, load_policy, placement)
