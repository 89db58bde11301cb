"""The operators' dashboard (issue 23) in headless Chromium against the real server, on the
database ``testing.backends.dashboard`` writes, with one learner step, a rollback version,
learning paused and a rollback pending; screenshots in /tmp/dash_*.png. The lifecycle (issue 22)
on the page: version 1 rejected and version 2 restoring version 0, then versions 3 and 4 on
probation with the learner's verdict on them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from sqlalchemy import insert

from core.control import ROLLBACK_TO, set_flag
from core.db import (
    LearnerCounter,
    LearnerStep,
    make_engine,
)
from core.records import utcnow
from testing.backends.dashboard import PROBATION_SAYS, STEP, add_lineage, populate, refuse_some
from testing.servers import ADMIN, make_settings, running_server

# --------------------------------------------------------------------------- the page in Chromium
# The page as it is between two refreshes, read in one script (a refresh redraws the charts).
SNAPSHOT_JS = """
const text = id => { const el = document.getElementById(id); return el.hidden ? "" : el.textContent.trim(); };
const all = (el, sel) => [...el.querySelectorAll(sel)];
const svg = id => {
  const el = document.getElementById(id);
  return {
    x_label: el.querySelector(".x-label").textContent, y_label: el.querySelector(".y-label").textContent,
    x_ticks: all(el, ".x-tick").map(t => t.textContent), y_ticks: all(el, ".y-tick").map(t => t.textContent),
    points: all(el, "circle.point").map(p => [p.getAttribute("cx"), p.getAttribute("cy")]),
    rollbacks: all(el, ".rollback-mark").length,
    vlines: all(el, ".rollback-line").map(l => l.getAttribute("x1")),
    labels: all(el, ".point-label").map(t => t.textContent),
    empty: el.innerHTML.includes("no data yet"),
  };
};
const badge = document.getElementById("learning");
return {
  text: Object.fromEntries(arguments[0].map(id => [id, text(id)])),
  charts: Object.fromEntries(arguments[1].map(id => [id, svg(id)])),
  learning_class: badge.className,
  learning_colour: getComputedStyle(badge).backgroundColor,
};
"""


TEXTS = (
    "learning",
    "rollback-pending",
    "guard-says",
    "policy-version",
    "newest-version",
    "newest-note",
    "learner-steps",
    "last-reward",
    "req-rate",
    "samples-trained",
    "samples-waiting",
    "dead-letters",
    "rollback-refused",
    "chat-refused",
    "chat-refused-by",
    "feedback-refused",
    "feedback-refused-by",
    "other-counters",
    "guard",
    "served-stage",
    "promoted-version",
    "candidate-version",
    "lineage",
    "stage-counts",
    "decision",
    "decision-detail",
)


CHARTS = ("c-reward", "c-version", "c-version-reward", "c-kept", "c-ev", "c-rps")


def read_page(driver) -> dict:
    """What the dashboard shows once it has refreshed: the texts by element id, the charts, the
    learning badge's class and colour, the console's errors."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "status").text.startswith("updated"))
    snap = driver.execute_script(SNAPSHOT_JS, list(TEXTS), list(CHARTS))
    seen = snap.pop("text") | snap
    seen["errors"] = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return seen


# Two columns of charts, with or without a scroll bar.
WIDTH = 1280


def screenshot(driver, path: str) -> None:
    """The whole page as a PNG at ``path`` (the window made as tall as the page)."""
    bottom, chrome = driver.execute_script(
        "return [document.body.getBoundingClientRect().bottom + 24, window.outerHeight - window.innerHeight]"
    )
    driver.set_window_size(WIDTH, int(bottom + chrome))
    driver.save_screenshot(path)


def look(driver, url: str, name: str) -> dict:
    driver.set_window_size(WIDTH, 1000)
    driver.get(f"{url}/dashboard")
    seen = read_page(driver)
    screenshot(driver, f"/tmp/dash_{name}.png")
    return seen


@pytest.mark.slow
async def test_dashboard_in_chromium(tmp_path, browser):
    settings = make_settings(tmp_path)
    async with running_server(settings, SimpleNamespace(version=1, adapters=None), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            empty = await asyncio.to_thread(look, browser, url, "empty")
            populate(settings.resolved_database_url)
            await asyncio.to_thread(refuse_some, lambda path, json: httpx.post(url + path, json=json))
            paused = await asyncio.to_thread(look, browser, url, "paused")
            assert (await http.post("/admin/resume", headers=ADMIN)).status_code == 200
            db = make_engine(settings.resolved_database_url)
            set_flag(db, ROLLBACK_TO, None)
            with db.begin() as conn:
                conn.execute(insert(LearnerCounter).values(name="dead_letters", value=5))
                conn.execute(
                    insert(LearnerStep),
                    [
                        dict(
                            run_id="r",
                            step=i,
                            version=1,
                            metrics=STEP | {"reward_mean": i / 40},
                            created_at=utcnow(),
                        )
                        for i in range(2, 41)
                    ],
                )
            db.dispose()
            verdict = add_lineage(settings.resolved_database_url)
            running = await asyncio.to_thread(look, browser, url, "running")

    # Nothing recorded: every chart says so, under its axis labels.
    assert empty["learning"] == "learning running" and empty["rollback-pending"] == ""
    assert (empty["newest-version"], empty["learner-steps"], empty["dead-letters"]) == ("none", "none", "0")
    assert (empty["guard"], empty["promoted-version"], empty["candidate-version"]) == (
        "guard only watches · probation",
        "none",
        "none",
    )
    assert empty["guard-says"] == PROBATION_SAYS
    assert (empty["decision"], empty["decision-detail"], empty["lineage"]) == ("–", "", "")
    assert all(c["empty"] for k, c in empty["charts"].items() if k != "c-rps")
    assert empty["charts"]["c-reward"]["x_label"] == "learner step"

    # Paused, a rollback pending, one learner step.
    assert paused["errors"] == [], paused["errors"]
    assert paused["learning"] == "LEARNING PAUSED" and "paused" in paused["learning_class"]
    assert paused["learning_colour"] != empty["learning_colour"]
    assert paused["rollback-pending"] == (
        "ROLLBACK PENDING: to version 1 (requested, not yet carried out by the learner)"
    )
    assert (paused["policy-version"], paused["newest-version"]) == ("1", "2")
    assert paused["newest-note"] == "a rollback to version 0; not served yet (serving 1)"
    assert (paused["learner-steps"], paused["last-reward"]) == ("1", "0.750")
    # 30 requests in the last 60 s (none in the last 10 s, where the old tile looked).
    assert paused["req-rate"] == "0.50"
    assert (paused["samples-trained"], paused["samples-waiting"]) == ("4", "3")
    # dead_letters: not a counter yet, shown as 0.
    assert (paused["dead-letters"], paused["rollback-refused"]) == ("0", "2")
    assert (paused["chat-refused"], paused["chat-refused-by"]) == ("1", "invalid_request 1")
    assert (paused["feedback-refused"], paused["feedback-refused-by"]) == ("1", "unknown 1")
    assert paused["other-counters"] == "other learner counters: expired 3"
    # The lifecycle: version 1 rejected (and served by this replica until it swaps), 2 promoted.
    assert (paused["guard"], paused["served-stage"], paused["promoted-version"]) == (
        "guard only watches · probation",
        "rejected",
        "2",
    )
    assert (paused["candidate-version"], paused["lineage"], paused["decision"]) == ("none", "", "–")
    assert paused["stage-counts"] == "promoted 2 · canary 0 · candidate 0 · rejected 1"
    reward = paused["charts"]["c-reward"]
    assert (reward["x_label"], reward["y_label"]) == ("learner step", "reward (0–1)")
    # One step: the x range is step 1 ± 1, its point in the middle of the plot (x: 56 + 388/2);
    # y: the reward's own range 0..1, 0.75 at 186 - 172 × 0.75 = 57.
    assert reward["x_ticks"] == ["0", "1", "2"] and reward["points"] == [["250.0", "57.0"]]
    assert reward["y_ticks"] == ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]
    # The rollback (version 2) came after step 1 (version 1): a line at step 1.5, 56 + 388 × 0.75.
    assert reward["vlines"] == ["347.0"] and reward["labels"] == ["↩ v0"]
    ev = paused["charts"]["c-ev"]
    # One value (0.3): its range is 0.3 ± 10 %, so 0.27..0.33.
    assert ev["y_ticks"] == ["0.28", "0.30", "0.32"] and len(ev["points"]) == 1
    version = paused["charts"]["c-version"]
    assert (version["x_label"], version["y_label"]) == ("time (local)", "policy version")
    # Versions 0 and 1 (served) as points, version 2 (the rollback to 0) marked; drawn by stage,
    # promoted (0, 2) before rejected (1).
    assert (
        len(version["points"]) == 2 and version["rollbacks"] == 1 and version["labels"] == ["↩ v0", "served"]
    )
    by_version = paused["charts"]["c-version-reward"]
    assert len(by_version["points"]) == 1 and by_version["rollbacks"] == 1
    assert paused["charts"]["c-rps"]["x_label"] == "seconds before now (bucket end)"

    # Resumed, the rollback carried out, 40 steps, 5 dead letters.
    assert running["errors"] == []
    assert running["learning"] == "learning running" and running["rollback-pending"] == ""
    assert running["dead-letters"] == "5" and running["learner-steps"] == "40"
    assert len(running["charts"]["c-reward"]["points"]) == 40
    # Versions 3 and 4 on probation, the guard off and version 2 pinned, the verdict shown.
    assert running["guard"] == "GUARD OFF · pinned to version 2"
    assert running["guard-says"] == (
        "off: every new version is promoted as it is recorded, with no comparison; pinned to version 2"
    )
    assert (running["candidate-version"], running["lineage"]) == ("4", "lineage: versions 3, 4")
    assert running["stage-counts"] == "promoted 2 · canary 2 · candidate 0 · rejected 1"
    assert running["decision"] == "continue"
    assert running["decision-detail"].startswith(
        f"Δ (lineage − promoted) in [{verdict.lower:.3f}, {verdict.upper:.3f}]; "
        "ratings: lineage 10 (mean 1.000), promoted 30 (mean 1.000); at "
    )
    # Five versions, one point each; the rollback (version 2) as a diamond, the rest circles.
    assert (
        len(running["charts"]["c-version"]["points"]) == 4
        and running["charts"]["c-version"]["rollbacks"] == 1
    )
