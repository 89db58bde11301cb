"""What every judge returns, and the interface the simulation calls.

Source: SAO paper §3.4 (binary reward ``r_quality × r_style``) and DESIGN §6.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from judge.styles import STYLE_NAMES


class JudgeFailure(RuntimeError):
    """The judge could not produce a verdict (bad or missing reply, model not loadable).

    Callers must not turn a failure into a reward: skip the feedback and count it.
    """


@dataclass(frozen=True)
class Judgement:
    """One judge verdict on one answer.

    - ``quality``: 1 if the answer is acceptable (non-empty, on topic, not degenerate, within
      length bounds), else 0.
    - ``style``: the detected style (a catalogue name).
    - ``style_score``: the detected style's score (judge-specific scale; 1.0 for the LLM judge).
    - ``scores``: score per candidate style, same scale.
    - ``target_style``: the style the simulated users currently prefer.
    - ``reasons``: human-readable notes, one per failed check plus the style decision.
    - ``reward`` (computed): ``quality × [style == target_style]`` in {0.0, 1.0} (SAO §3.4).
    """

    quality: int
    style: str
    style_score: float
    scores: dict[str, float]
    target_style: str
    reasons: list[str] = field(default_factory=list)
    reward: float = field(init=False)

    def __post_init__(self) -> None:
        if self.quality not in (0, 1):
            raise ValueError(f"quality must be 0 or 1, got {self.quality!r}")
        # Frozen dataclass: the reward is derived, never passed in, so it cannot disagree.
        object.__setattr__(self, "reward", float(self.quality * (self.style == self.target_style)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (all fields including ``reward``)."""
        return asdict(self)


class Judge(ABC):
    """Scores answers to writing requests against a target style (SAO §3.4, DESIGN §6)."""

    def __init__(self, styles: Iterable[str] | None = None) -> None:
        """``styles``: the candidate styles the judge chooses among (default: the catalogue).

        Raises ``ValueError`` on an unknown style or an empty list.
        """
        chosen = tuple(styles) if styles is not None else STYLE_NAMES
        unknown = [s for s in chosen if s not in STYLE_NAMES]
        if unknown or not chosen:
            raise ValueError(f"bad judge styles {chosen}; known: {', '.join(STYLE_NAMES)}")
        self.styles: tuple[str, ...] = chosen

    def check_target(self, target_style: str) -> None:
        """Raise ``ValueError`` unless ``target_style`` is one of this judge's styles."""
        if target_style not in self.styles:
            raise ValueError(f"target style {target_style!r} not among {', '.join(self.styles)}")

    @abstractmethod
    def judge(self, request: str, answer: str, target_style: str) -> Judgement:
        """Judge one answer. Raises ``JudgeFailure`` when no verdict can be produced."""

    def judge_many(self, items: Iterable[tuple[str, str, str]]) -> list[Judgement]:
        """Judge ``(request, answer, target_style)`` triples, in order.

        Subclasses batch where that is cheaper; the result is the same as calling ``judge``
        on each item. Raises ``JudgeFailure`` on the first item without a verdict.
        """
        return [self.judge(request, answer, target) for request, answer, target in items]

    def try_judge_many(self, items: Iterable[tuple[str, str, str]]) -> list[Judgement | JudgeFailure]:
        """Like ``judge_many``, but each item's result is its ``Judgement`` or its
        ``JudgeFailure``, so one failure does not lose the other verdicts.

        Tries one batched ``judge_many`` first and falls back to item-by-item on a failure.
        """
        items = list(items)
        try:
            return list(self.judge_many(items))
        except JudgeFailure:
            pass
        out: list[Judgement | JudgeFailure] = []
        for request, answer, target in items:
            try:
                out.append(self.judge(request, answer, target))
            except JudgeFailure as exc:
                out.append(exc)
        return out
