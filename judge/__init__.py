"""Judges and the online preference-shift simulation's catalogue (SAO paper §3.4, docs/design.md §6).

- ``judge.base``: ``Judgement``, the ``Judge`` interface, ``JudgeFailure``.
- ``judge.styles``: the style catalogue, schedules, the SAO system prompt, shipped data.
- ``judge.offline``: ``OfflineJudge``, the default judge (MiniLM embeddings + rules, no network).
- ``judge.llm``: ``LLMJudge`` over any OpenAI-compatible chat endpoint.
- ``judge.simulate``: the simulation client, lockstep (``sync``, ``judge.sim_lockstep``) or open
  loop (``async``, ``judge.sim_openloop``), its settings and result (``judge.sim_config``,
  ``judge.sim_result``) and one request's round trip (``judge.sim_client``);
  ``judge.chatstream`` reassembles its streamed answers, ``judge.pacing`` paces its traffic.
- ``judge.runstats``: an online run's staleness distribution, feedback→served latency, rates.
- ``judge.metrics``: AUC, last-5 mean, adaptation lag, style shares, the learner's step
  metrics, seeds; ``judge.plots`` draws them; ``judge.report`` writes the report.
"""

from judge.base import Judge, JudgeFailure, Judgement
from judge.llm import LLMJudge
from judge.offline import OfflineJudge
from judge.styles import (
    CATALOGUE,
    NAMED_SCHEDULES,
    STYLE_NAMES,
    Schedule,
    Segment,
    Style,
    default_schedule,
    schedule_from_spec,
    system_prompt,
)

__all__ = [
    "CATALOGUE",
    "NAMED_SCHEDULES",
    "STYLE_NAMES",
    "Judge",
    "JudgeFailure",
    "Judgement",
    "LLMJudge",
    "OfflineJudge",
    "Schedule",
    "Segment",
    "Style",
    "default_schedule",
    "schedule_from_spec",
    "system_prompt",
]
