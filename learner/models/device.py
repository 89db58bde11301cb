"""The learner's device: the ``LearnerConfig.device`` setting resolved to a ``torch.device``.

Issue 38, docs/scaling.md ("The learner on GPUs and across processes"). The learner keeps everything it trains with
on one device: the policy, the critic, the KL reference, the π_old copies of the off-policy
family (``learner.algo.old_logits``) and the optimiser states (built over parameters already there);
a batch is moved there once, at the start of a step (``Batch.to``). With N ranks
(``learner.distributed``) rank r of a host takes its GPU ``local_rank`` (``LOCAL_RANK`` of
``torchrun``), or the CPU.
"""

from __future__ import annotations

import torch

from learner.config import Device


class DeviceError(ValueError):
    """The device setting cannot be met on this machine (``cuda`` where no GPU is visible, or
    fewer GPUs than ranks on a host); the message names the setting and what is missing."""


def resolve(setting: Device, local_rank: int = 0) -> torch.device:
    """The ``torch.device`` the learner of ``setting`` runs on.

    Args:
        setting: ``auto`` (a GPU where one is visible, else the CPU), ``cpu`` or ``cuda``.
        local_rank: the rank's index on its host (0 for a single learner); with a GPU, the
            rank takes GPU ``local_rank``.

    Raises:
        DeviceError: ``cuda`` without a visible CUDA GPU, or ``local_rank`` beyond the GPUs
            visible (with ``auto``, a rank beyond them also fails rather than mixing devices).
    """
    setting = Device(setting)
    if setting == Device.CPU:
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if not available:
        if setting == Device.CUDA:
            raise DeviceError(
                "the learner's device is cuda but no CUDA GPU is visible here (torch "
                f"{torch.__version__}, torch.cuda.is_available() is False): use --device cpu or auto"
            )
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"rank {local_rank} of this host needs GPU {local_rank}, but {count} are visible: "
            "run at most one rank per GPU (torchrun --nproc-per-node)"
        )
    return torch.device("cuda", local_rank)
