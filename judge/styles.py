"""The style catalogue, the preference-shift schedules and the SAO system prompt.

Source: SAO paper §3.4 (online learning simulation; the write-ups in ``papers/001_…txt`` and
``papers/003_…txt``) and docs/design.md §6. The paper's judge prefers, in turn, cute, chuunibyou and
classical writing; the reward is ``r_quality × r_style``. The paper does not give segment
lengths, so the named schedules use 40 steps per style (a project choice, configurable).

Data shipped with the package (``judge/data``):

- ``exemplars.json``: ``{style: [text, ...]}``, at least 12 texts per style; the offline
  judge builds its style prototypes from them.
- ``labelled.json``: ``[{"style", "request", "text"}, ...]``, at least 30 texts per style,
  disjoint from the exemplars; used only to measure the judges (``bench/judge_accuracy.py``).
- ``requests.json``: ``[request, ...]``, the writing requests the simulation draws from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Style:
    """A writing style the policy may choose.

    ``description`` is the one line the system prompt shows the policy (and the LLM judge's
    rubric shows the judge).
    """

    name: str
    description: str


# Ordered: the paper's three styles first, then extra candidates that a 135M chat model
# (SmolLM2-135M-Instruct) is more likely to produce unprompted, then ``plain``, the usual
# assistant register. ``plain`` exists so that a neutral answer is detected as neutral instead
# of being forced into the nearest stylised class (which would inflate the reward of
# whichever target is closest to the model's default voice).
CATALOGUE: dict[str, Style] = {
    s.name: s
    for s in (
        Style("cute", "playful and sweet, with exclamation marks, emoji and cuddly little words"),
        Style(
            "chuunibyou",
            "dramatic dark-fantasy hero talk, as if you had sealed powers and a grand destiny",
        ),
        Style("classical", "old-fashioned archaic English (thee, thou, hath, doth), like an old book"),
        Style("formal", "polished, professional and impersonal, like an official letter or report"),
        Style("casual", "relaxed and chatty, like texting a friend (contractions, slang)"),
        Style("poetic", "lyrical modern prose or verse full of imagery and metaphor"),
        Style("pirate", "talk like a pirate (arr, matey, ye, treasure and the sea)"),
        Style("concise", "as short as possible: one plain sentence of a few words"),
        Style("plain", "neutral, clear and helpful, the usual assistant voice"),
    )
}

STYLE_NAMES: tuple[str, ...] = tuple(CATALOGUE)

# Steps per style in the named schedules (the paper does not report its segment lengths).
DEFAULT_STEPS_PER_STYLE = 40

# "paper" is the SAO §3.4 order. "default" uses the styles the offline judge detects most
# precisely that SmolLM2-135M-Instruct also produced in a small base-model sample
# (docs/judge.md), so that the first rewards are not all zero; measure the served model's
# shares (bench/base_style_shares.py) and pass another schedule as ``--schedule``.
NAMED_SCHEDULES: dict[str, tuple[str, ...]] = {
    "paper": ("cute", "chuunibyou", "classical"),
    "default": ("cute", "pirate", "poetic"),
}

SCHEDULE_ENV = "SAOSERVE_STYLE_SCHEDULE"


@dataclass(frozen=True)
class Segment:
    """One stretch of the schedule: ``style`` is the target for ``steps`` learner steps."""

    style: str
    steps: int


@dataclass(frozen=True)
class Schedule:
    """A piecewise-constant target style over learner steps (step 0 is the first step)."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a schedule needs at least one segment")
        for seg in self.segments:
            if seg.style not in CATALOGUE:
                raise ValueError(f"unknown style {seg.style!r}; known: {', '.join(STYLE_NAMES)}")
            if seg.steps < 1:
                raise ValueError(f"segment {seg.style!r} has {seg.steps} steps; need >= 1")

    @property
    def total_steps(self) -> int:
        """Number of learner steps the schedule covers."""
        return sum(seg.steps for seg in self.segments)

    @property
    def starts(self) -> list[int]:
        """First step of each segment (the first is 0)."""
        out, step = [], 0
        for seg in self.segments:
            out.append(step)
            step += seg.steps
        return out

    @property
    def switch_steps(self) -> list[int]:
        """Steps at which the target changes: the start of every segment after the first."""
        return self.starts[1:]

    @property
    def styles(self) -> list[str]:
        """The distinct target styles, in first-use order (what the system prompt offers)."""
        return list(dict.fromkeys(seg.style for seg in self.segments))

    def target_at(self, step: int) -> str:
        """Target style at ``step``; steps past the end keep the last segment's style.

        Raises ``ValueError`` for a negative step.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for start, seg in zip(self.starts, self.segments, strict=True):
            if step < start + seg.steps:
                return seg.style
        return self.segments[-1].style

    def to_spec(self) -> str:
        """The spec string ``schedule_from_spec`` parses back into this schedule."""
        return ",".join(f"{seg.style}:{seg.steps}" for seg in self.segments)

    def as_dicts(self) -> list[dict[str, Any]]:
        """JSON form: ``[{"style", "start", "end"}]`` with ``end`` exclusive, in steps."""
        return [
            {"style": seg.style, "start": start, "end": start + seg.steps}
            for start, seg in zip(self.starts, self.segments, strict=True)
        ]


def schedule_from_spec(spec: str, steps_per_style: int = DEFAULT_STEPS_PER_STYLE) -> Schedule:
    """Parse a schedule.

    ``spec`` is either a named schedule (``"paper"``, ``"default"``; each style then lasts
    ``steps_per_style`` steps) or a comma-separated list of ``style:steps`` items, e.g.
    ``"cute:40,formal:40"`` (switch points at step 40). Whitespace is ignored.

    Raises ``ValueError`` on an empty spec, an unknown style or name, or a bad step count.
    """
    spec = spec.strip()
    if spec in NAMED_SCHEDULES:
        return Schedule(tuple(Segment(s, steps_per_style) for s in NAMED_SCHEDULES[spec]))
    if not spec:
        raise ValueError("empty schedule spec")
    segments = []
    for item in spec.split(","):
        name, sep, steps = item.partition(":")
        if not sep:
            raise ValueError(f"schedule item {item.strip()!r} is not 'style:steps' (spec {spec!r})")
        try:
            n = int(steps.strip())
        except ValueError:
            raise ValueError(f"schedule item {item.strip()!r}: steps must be an integer") from None
        segments.append(Segment(name.strip(), n))
    return Schedule(tuple(segments))


def default_schedule() -> Schedule:
    """The configured schedule: ``$SAOSERVE_STYLE_SCHEDULE`` (a spec or name) or ``"default"``."""
    return schedule_from_spec(os.environ.get(SCHEDULE_ENV, "") or "default")


def system_prompt(styles: list[str] | tuple[str, ...]) -> str:
    """The SAO §3.4 system prompt: answer the writing request in one of ``styles``.

    The policy chooses the style itself; the reward (not the prompt) tells it which one the
    simulated users currently prefer. Raises ``ValueError`` for an unknown or empty list.
    """
    if not styles:
        raise ValueError("system_prompt needs at least one style")
    unknown = [s for s in styles if s not in CATALOGUE]
    if unknown:
        raise ValueError(f"unknown styles {unknown}; known: {', '.join(STYLE_NAMES)}")
    lines = "\n".join(f"- {s}: {CATALOGUE[s].description}" for s in styles)
    return (
        "Answer the user's writing request in one of these styles:\n"
        f"{lines}\n"
        "Choose one style and keep it for the whole answer. Answer in English, in under 100 words."
    )


def _load(name: str) -> Any:
    return json.loads(resources.files("judge.data").joinpath(name).read_text(encoding="utf-8"))


@cache
def exemplars() -> dict[str, list[str]]:
    """Exemplar texts per style (``judge/data/exemplars.json``), used to build prototypes."""
    data = _load("exemplars.json")
    return {style: list(data[style]) for style in STYLE_NAMES}


@cache
def labelled() -> list[dict[str, str]]:
    """Held-out labelled texts ``[{"style", "request", "text"}]`` (``judge/data/labelled.json``)."""
    return list(_load("labelled.json"))


@cache
def writing_requests() -> list[str]:
    """The simulation's writing requests (``judge/data/requests.json``)."""
    return list(_load("requests.json"))
