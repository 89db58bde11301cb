"""The settings of one simulation run (``judge.simulate``): the server, the schedule, the batch,
the traffic (lockstep or open loop, its rate, feedback delay, backlog cap, pacing, prompt pool)
and the adversary; validated when made.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.keys import check_tenant
from judge.adversary import Adversary
from judge.styles import Schedule

MODES = ("sync", "async")

# The settings a report states with its numbers (``SimulationResult.traffic``).
TRAFFIC_FIELDS = (
    "mode",
    "batch_size",
    "concurrency",
    "rate",
    "feedback_delay_s",
    "max_backlog",
    "pace",
    "prompt_pool",
    "max_tokens",
    "temperature",
    "seed",
)


@dataclass
class SimulationConfig:
    """One simulation run. ``steps`` defaults to the schedule's length (in learner versions).

    ``rate`` (requests/s) and ``feedback_delay_s`` (seconds, mean of an exponential; 0 = at
    once), ``max_seconds`` and ``max_backlog`` (new requests are held while the samples
    waiting for the learner, estimated as feedback posted minus ``batch_size`` per new version,
    plus the answers still on their way to feedback reach it; None = never held) and ``pace``
    (space admissions by ``pace_gap``; with a fixed number in flight, not with ``rate``) apply
    to ``mode="async"``. ``prompt_pool``: cycle the first K
    writing requests in order instead of sampling all of them. ``adversary``: the cohort of
    raters that rate by their own rule (``judge.adversary``, among its own ``users``; None:
    every rater is honest). ``users``: the honest simulated users without an adversary; each
    request carries its user's name as ``user`` (``sim-user-NN``), so the guard's identity cap
    can count their votes when it binds every identity (``GuardConfig.vote_cap``
    ``identities``; docs/guard.md, "Who votes").

    ``api_key``: the bearer of the chat, feedback and model-list requests (None: none is sent,
    the server serves them anonymously or refuses them, ``require_keys``); ``admin_key`` stays
    the bearer of the ``/admin`` routes. ``policy``: the policy those admin reads are about,
    sent as ``?policy=`` (docs/tenants.md, "A policy per tenant"; None: the server's default,
    the global policy). A tenant's run sets both: a key of the tenant, and its name.
    """

    base_url: str
    schedule: Schedule
    batch_size: int = 8
    steps: int | None = None
    concurrency: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int = 0
    one_in_flight_per_prompt: bool = True
    uncertainty_sampler: bool = False
    wait_for_version: bool = True
    version_timeout_s: float = 600.0
    admin_key: str | None = None
    n_prompts: int | None = None
    mode: str = "sync"
    rate: float | None = None
    feedback_delay_s: float = 0.0
    max_seconds: float | None = None
    max_backlog: int | None = None
    prompt_pool: int | None = None
    pace: bool = False
    adversary: Adversary | None = None
    users: int = 200
    api_key: str | None = None
    policy: str | None = None

    @property
    def total_steps(self) -> int:
        """Learner steps (versions) the run covers: ``steps``, or the schedule's length."""
        return self.steps or self.schedule.total_steps

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose sync or async")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.feedback_delay_s < 0:
            raise ValueError(f"feedback_delay_s must be >= 0, got {self.feedback_delay_s}")
        if self.users < 1:
            raise ValueError(f"users must be >= 1, got {self.users}")
        if self.prompt_pool is not None and self.prompt_pool < 1:
            raise ValueError(f"prompt_pool must be >= 1, got {self.prompt_pool}")
        if self.pace and (self.mode != "async" or self.rate is not None):
            raise ValueError("pace applies to async mode with a fixed number in flight, not with a rate")
        if self.policy is not None:
            check_tenant(self.policy)
