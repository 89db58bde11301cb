"""Single-rollout baselines that need no critic (docs/design.md §5.6).

SAO's comparison baseline (SAO §3.4): per prompt, the mean of its last 8 rewards; the
advantage is R minus that mean on every action token.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import torch


class RunningMeanBaseline:
    """Per-prompt running-mean reward baseline (the SAO §3.4 comparison, docs/design.md §5.6).

    ``baseline(prompt) = mean of that prompt's last ``window`` rewards``, or ``default`` for a prompt
    never seen (0.5: the middle of [0, 1], the same starting point as the critic's head). Baselines
    for a batch are read before the batch's rewards are recorded, so a trajectory never baselines
    against its own reward. At most ``max_prompts`` prompts are remembered (least recently updated
    forgotten first) so memory stays bounded on a server with unbounded distinct prompts.
    """

    def __init__(self, window: int = 8, default: float = 0.5, max_prompts: int = 100_000) -> None:
        if window < 1 or max_prompts < 1:
            raise ValueError("window and max_prompts must be >= 1")
        self.window = window
        self.default = default
        self.max_prompts = max_prompts
        self._history: OrderedDict[str, deque[float]] = OrderedDict()

    def baselines(self, prompt_ids: Sequence[str]) -> torch.Tensor:
        """[len(prompt_ids)] float32 baselines from the history before this call."""
        out = []
        for pid in prompt_ids:
            h = self._history.get(pid)
            out.append(sum(h) / len(h) if h else self.default)
        return torch.tensor(out, dtype=torch.float32)

    def update(self, prompt_ids: Sequence[str], rewards: Sequence[float]) -> None:
        """Record one reward per prompt id (in order)."""
        for pid, r in zip(prompt_ids, rewards, strict=True):
            h = self._history.pop(pid, None) or deque(maxlen=self.window)
            h.append(float(r))
            self._history[pid] = h
            while len(self._history) > self.max_prompts:
                self._history.popitem(last=False)

    def state_dict(self) -> dict:
        """Plain-python state: window, default, max_prompts and each prompt's recent rewards."""
        return {
            "window": self.window,
            "default": self.default,
            "max_prompts": self.max_prompts,
            "history": {k: list(v) for k, v in self._history.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from ``state_dict()`` output."""
        self.window = int(state["window"])
        self.default = float(state["default"])
        self.max_prompts = int(state["max_prompts"])
        self._history = OrderedDict((k, deque(v, maxlen=self.window)) for k, v in state["history"].items())
