"""Report metrics with hand-computed values, and the written report (DESIGN §6)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from judge.report import (
    adaptation_lag,
    last_k_mean,
    load_records,
    main,
    normalized_auc,
    per_step,
    rolling_share,
    write_report,
)
from judge.styles import schedule_from_spec


def test_normalized_auc_by_hand() -> None:
    assert normalized_auc([0, 1, 1]) == pytest.approx((0.5 + 1) / 2)
    assert normalized_auc([1, 0]) == pytest.approx(0.5)
    assert normalized_auc([0.25]) == 0.25
    assert normalized_auc([0, 0, 1, 1]) == pytest.approx((0 + 0.5 + 1) / 3)
    with pytest.raises(ValueError):
        normalized_auc([])


@given(st.lists(st.floats(0, 1), min_size=1, max_size=50))
def test_normalized_auc_lies_between_min_and_max(rewards: list[float]) -> None:
    auc = normalized_auc(rewards)
    assert min(rewards) - 1e-9 <= auc <= max(rewards) + 1e-9


def test_last_k_mean() -> None:
    assert last_k_mean([0, 0, 1, 1, 1, 0, 1]) == pytest.approx(4 / 5)
    assert last_k_mean([1, 0], k=5) == 0.5
    assert last_k_mean([0, 1, 1], k=1) == 1.0
    with pytest.raises(ValueError):
        last_k_mean([])
    with pytest.raises(ValueError):
        last_k_mean([1], k=0)


def test_adaptation_lag_by_hand() -> None:
    #          step: 0    1    2    3    4    5    6    7    8    9
    series = [0.9, 0.9, 0.9, 0.1, 0.3, 0.6, 0.0, 0.2, 0.4, 0.45]
    # switch at 3: share reaches 0.5 at step 5 -> lag 2; switch at 6: never reaches 0.5 -> None.
    assert adaptation_lag(series, [3, 6]) == [2, None]
    assert adaptation_lag(series, [3, 6], threshold=0.4) == [2, 2]
    assert adaptation_lag(series, [3, 6], threshold=0.3) == [1, 2]
    # Already at the threshold on the switch step: lag 0 (the comparison is >=).
    assert adaptation_lag([0.0, 0.5, 0.5], [1]) == [0]
    # A crossing only after the next switch does not count for the earlier one.
    assert adaptation_lag([0, 0.1, 0.1, 0.9, 0.9], [1, 3]) == [None, 0]
    assert adaptation_lag([0.2, 0.3], []) == []
    # A switch past the end of the series never adapts.
    assert adaptation_lag([0.2, 0.3], [5]) == [None]
    with pytest.raises(ValueError):
        adaptation_lag([0.0] * 5, [3, 2])


def test_rolling_share_by_hand() -> None:
    steps = [["cute", "plain"], ["cute", "cute"], ["formal", "formal", "formal", "cute"]]
    per = rolling_share(steps, 1)
    assert list(per) == ["cute", "formal", "plain"]  # catalogue order
    assert per["cute"] == [0.5, 1.0, 0.25]
    assert per["plain"] == [0.5, 0.0, 0.0]
    two = rolling_share(steps, 2, styles=["cute", "formal"])
    assert two["cute"] == [0.5, 3 / 4, 3 / 6]
    assert two["formal"] == [0.0, 0.0, 3 / 6]
    empty = rolling_share([[], ["cute"]], 1)
    assert math.isnan(empty["cute"][0]) and empty["cute"][1] == 1.0
    with pytest.raises(ValueError):
        rolling_share(steps, 0)


SCHEDULE = schedule_from_spec("cute:2,formal:3")


def _rec(step: int, detected: str, reward: float) -> dict[str, object]:
    return {
        "step": step,
        "target_style": SCHEDULE.target_at(step),
        "detected_style": detected,
        "reward": reward,
    }


RECORDS = [
    _rec(0, "plain", 0.0),
    _rec(0, "cute", 1.0),
    _rec(1, "cute", 1.0),
    _rec(1, "cute", 1.0),
    _rec(2, "cute", 0.0),
    _rec(2, "cute", 0.0),
    _rec(3, "formal", 1.0),
    _rec(3, "cute", 0.0),
    _rec(4, "formal", 1.0),
    _rec(4, "formal", 0.0),  # detected formal, but quality 0
]


def test_per_step_validates() -> None:
    series = per_step(RECORDS, SCHEDULE)
    assert series.reward == [0.5, 1.0, 0.0, 0.5, 0.5]
    assert series.target == ["cute", "cute", "formal", "formal", "formal"]
    with pytest.raises(ValueError, match="lacks"):
        per_step([{"step": 0, "reward": 1.0}], SCHEDULE)
    with pytest.raises(ValueError, match="schedule's target"):
        per_step([{**_rec(0, "cute", 1.0), "target_style": "formal"}], SCHEDULE)
    with pytest.raises(ValueError, match="without records"):
        per_step([_rec(0, "cute", 1.0), _rec(2, "cute", 1.0)], SCHEDULE)
    with pytest.raises(ValueError, match="reward"):
        per_step([_rec(0, "cute", 1.5)], SCHEDULE)
    with pytest.raises(ValueError, match="step"):
        per_step([{**_rec(0, "cute", 1.0), "step": -1}], SCHEDULE)
    with pytest.raises(ValueError):
        per_step([], SCHEDULE)


def test_write_report(tmp_path: Path) -> None:
    baseline = [_rec(r["step"], "cute", 0.0) for r in RECORDS]  # never adapts to formal
    out = tmp_path / "report"
    metrics = write_report(out, SCHEDULE, {"sao": RECORDS, "running mean": baseline})
    for name in (
        "metrics.json",
        "index.html",
        "comparison.png",
        "reward.png",
        "style_share_sao.png",
        "style_share_running_mean.png",
    ):
        assert (out / name).stat().st_size > 0, name
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert on_disk["schedule"] == [
        {"style": "cute", "start": 0, "end": 2},
        {"style": "formal", "start": 2, "end": 5},
    ]
    sao = on_disk["methods"]["sao"]
    # per-step rewards 0.5, 1, 0, 0.5, 0.5: trapezoids 0.75 + 0.5 + 0.25 + 0.5 = 2.0 over 4.
    assert sao["auc"] == pytest.approx(0.5)
    assert sao["last5_mean"] == pytest.approx(2.5 / 5)
    # formal's share at steps 2, 3, 4 = 0, 0.5, 1 -> reaches 0.5 one step after the switch.
    assert sao["adaptation_lag"] == [1]
    assert sao["style_share"]["formal"] == [0.0, 0.0, 0.0, 0.5, 1.0]
    assert sao["style_share"]["cute"] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert sao["target_share"] == [0.5, 1.0, 0.0, 0.5, 1.0]
    assert sao["segment_mean_reward"] == pytest.approx([0.75, 1 / 3])
    assert (sao["steps"], sao["records"]) == (5, 10)
    assert on_disk["methods"]["running mean"]["adaptation_lag"] == [None]
    page = (out / "index.html").read_text()
    assert 'src="comparison.png"' in page and 'src="style_share_running_mean.png"' in page
    assert "http://" not in page and "https://" not in page
    assert "never" in page  # the baseline's lag


def test_write_report_window_and_spec(tmp_path: Path) -> None:
    metrics = write_report(tmp_path, "cute:2,formal:3", {"sao": RECORDS}, window=2, threshold=0.6)
    share = metrics["methods"]["sao"]["style_share"]["formal"]
    assert share == pytest.approx([0.0, 0.0, 0.0, 0.25, 0.75])
    assert metrics["methods"]["sao"]["adaptation_lag"] == [2]
    with pytest.raises(ValueError):
        write_report(tmp_path, SCHEDULE, {})


def test_cli_reads_json_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sao.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    listed = tmp_path / "rm.json"
    listed.write_text(json.dumps(RECORDS))
    assert load_records(path) == load_records(listed) == RECORDS
    main(
        [
            "--schedule",
            "cute:2,formal:3",
            "--method",
            f"sao={path}",
            "--method",
            f"rm={listed}",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert "index.html" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "out" / "metrics.json").read_text())["methods"]) == {"sao", "rm"}
