"""The chat page (``GET /chat``): two turns of one conversation clicked through in headless
Chromium, the page's ratings found in the database and the log. Without a browser, the pages'
promise to reach nothing beyond the server they came from: tests/unit/server/test_chat_page.py."""

from __future__ import annotations

import asyncio

import httpx
from sqlalchemy import select

from core.db import FeedbackClaim, make_engine
from core.logbus import open_log
from core.records import FeedbackRecord, TrajectoryRecord, feedback_token
from testing.logs import read_topic
from testing.servers import make_settings, running_server

# One answer's wait: the first request on a fresh engine warms it up.
ANSWER_TIMEOUT_S = 180


def turn_done(driver, n: int):
    """The ``n``-th assistant turn once its answer is whole (thumbs enabled) or has failed."""
    from selenium.webdriver.common.by import By

    turns = driver.find_elements(By.CSS_SELECTOR, ".turn.assistant")
    if len(turns) <= n:
        return None
    turn = turns[n]
    if turn.find_element(By.CSS_SELECTOR, ".up").is_enabled() or "failed" in turn.get_attribute("class"):
        return turn
    return None


def feedback_shown(turn) -> str | None:
    """The rating's result once the server has answered (not while it is being sent)."""
    from selenium.webdriver.common.by import By

    text = turn.find_element(By.CSS_SELECTOR, ".feedback-result").text
    return text if text and text != "sending…" else None


def click_through(driver, url: str, secret: str) -> dict:
    """Two turns of one conversation as a person makes them; what the page showed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, ANSWER_TIMEOUT_S)
    driver.get(f"{url}/chat")
    wait.until(lambda d: "policy version 0" in d.find_element(By.ID, "served").text)
    seen: dict = {"dashboard_href": driver.find_element(By.LINK_TEXT, "dashboard").get_attribute("href")}
    tokens = driver.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("12")

    # Turn 1: typed, sent with the button, rated thumbs up in the page.
    driver.find_element(By.ID, "message").send_keys("Name a colour.")
    driver.find_element(By.ID, "send").click()
    t1 = wait.until(lambda d: turn_done(d, 0))
    t1.find_element(By.CSS_SELECTOR, ".up").click()
    seen["feedback1"] = wait.until(lambda d: feedback_shown(t1))

    # Turn 2: sent with Enter, so the page sends both turns; rated first by another client,
    # then in the page, which shows the server's 409.
    driver.find_element(By.ID, "message").send_keys("And another one?", Keys.ENTER)
    t2 = wait.until(lambda d: turn_done(d, 1))
    id2 = t2.get_attribute("data-completion-id")
    r = httpx.post(
        f"{url}/v1/feedback",
        json={"id": id2, "feedback_token": feedback_token(secret, id2), "thumbs": "down"},
        timeout=60,
    )
    seen["other_client"] = r.status_code
    t2.find_element(By.CSS_SELECTOR, ".up").click()
    seen["feedback2"] = wait.until(lambda d: feedback_shown(t2))

    for name, turn in (("turn1", t1), ("turn2", t2)):
        seen[name] = {
            "class": turn.get_attribute("class"),
            "id": turn.get_attribute("data-completion-id"),
            "version_attr": turn.get_attribute("data-policy-version"),
            "version_label": turn.find_element(By.CSS_SELECTOR, ".version").text,
            "answer": turn.find_element(By.CSS_SELECTOR, ".content").text,
            "enabled": [b.is_enabled() for b in turn.find_elements(By.CSS_SELECTOR, ".rate button")],
            "chosen": turn.find_element(By.CSS_SELECTOR, ".up").get_attribute("class"),
        }
    seen["user_turns"] = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".turn.user .content")]
    seen["console_errors"] = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return seen


async def test_a_person_chats_and_rates_in_chromium(policy_engine, tmp_path, pg_url, browser):
    settings = make_settings(tmp_path, database_url=pg_url)
    async with running_server(settings, policy_engine) as url:
        # Selenium blocks; the server runs on this event loop, so the browser runs in a thread.
        seen = await asyncio.to_thread(click_through, browser, url, settings.feedback_secret)

    assert seen["dashboard_href"] == f"{url}/dashboard"
    assert seen["user_turns"] == ["Name a colour.", "And another one?"]
    id1, id2 = seen["turn1"]["id"], seen["turn2"]["id"]
    for name in ("turn1", "turn2"):
        turn = seen[name]
        assert "failed" not in turn["class"], seen
        assert (turn["version_label"], turn["version_attr"]) == ("policy version 0", "0")
        assert turn["answer"].strip(), seen
        assert turn["enabled"] == [False, False]  # no second rating from the page
    assert seen["feedback1"] == "202 accepted: reward 1"
    assert "chosen" in seen["turn1"]["chosen"] and "chosen" not in seen["turn2"]["chosen"]
    assert seen["other_client"] == 202
    assert (
        seen["feedback2"] == f"409 conflict: feedback was already given for completion '{id2}' (first wins)"
    )
    # Nothing refused by the page's Content-Security-Policy, no script error: the one error the
    # console shows is the browser's note on the 409 answer.
    assert [m for m in seen["console_errors"] if "status of 409 (Conflict)" not in m] == []
    assert len(seen["console_errors"]) == 1 and "/v1/feedback" in seen["console_errors"][0]

    # The database: each completion's claim received with the first rating's reward.
    db = make_engine(pg_url)
    try:
        with db.connect() as conn:
            claims = conn.execute(
                select(FeedbackClaim.target, FeedbackClaim.state, FeedbackClaim.reward)
            ).all()
    finally:
        db.dispose()
    assert sorted(claims) == sorted([(f"t:{id1}", "received", 1.0), (f"t:{id2}", "received", 0.0)])

    # The log: one feedback record per completion (the 409 wrote none), and turn 2's prompt
    # holds the whole conversation the page kept.
    log = open_log(settings.resolved_log_url)
    try:
        fb = [FeedbackRecord.model_validate_json(e.value) for e in read_topic(log, "feedback")]
        trajs = [TrajectoryRecord.model_validate_json(e.value) for e in read_topic(log, "trajectories")]
    finally:
        log.close()
    assert sorted((r.trajectory_id, r.reward, r.source) for r in fb) == sorted(
        [(id1, 1.0, "user"), (id2, 0.0, "user")]
    )
    assert [t.id for t in trajs] == [id1, id2]
    prompt2 = policy_engine.tokenizer.decode(trajs[1].prompt_token_ids)
    answer1 = seen["turn1"]["answer"].strip()
    at = [prompt2.find(s) for s in ("Name a colour.", answer1, "And another one?")]
    assert -1 not in at and at == sorted(at), (prompt2, answer1)
