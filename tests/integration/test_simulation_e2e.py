"""The simulation for a few steps against the real server and learner, and the dashboard in
headless Chromium."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading

import httpx
import pytest

from judge.report import write_report
from judge.sim_config import SimulationConfig
from judge.simulate import Simulation
from judge.styles import schedule_from_spec
from learner.process import Learner, LearnerConfig
from saoserve.model import weights_sha256
from testing.dependencies import IN_CI
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def offline_judge():
    from judge.offline import OfflineJudge

    return OfflineJudge()


def chromium_dom(url: str) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if IN_CI:
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    out = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--user-data-dir=/tmp/saoserve-chromium",
            "--virtual-time-budget=8000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


async def test_simulation_steps_learner_and_dashboard(policy_engine, model_dir, tmp_path, offline_judge):
    settings = make_settings(tmp_path, model_dir=model_dir, policy_dir=tmp_path / "policies")
    schedule = schedule_from_spec("cute:1,pirate:1")
    stop = threading.Event()
    thread = threading.Thread()
    try:
        async with running_server(settings, policy_engine) as url:
            # kl_coef > 0: the learner also loads the base model as the KL anchor's reference.
            learner = Learner(
                settings,
                LearnerConfig(
                    batch_size=2, poll_s=0.2, checkpoint_every=100, algorithm={"name": "sao", "kl_coef": 0.1}
                ),
            )
            await asyncio.to_thread(learner.load)
            thread = threading.Thread(target=learner.run, args=(stop,), daemon=True)
            thread.start()
            cfg = SimulationConfig(
                base_url=url,
                schedule=schedule,
                batch_size=2,
                max_tokens=12,
                concurrency=2,
                seed=1,
                n_prompts=4,
                version_timeout_s=300,
                admin_key=settings.admin_key,
                uncertainty_sampler=True,
            )
            steps_seen: list[int] = []
            result = await Simulation(cfg, offline_judge, on_step=lambda s, r: steps_seen.append(s)).run()
            assert steps_seen == [0, 1] and result.request_failures == 0 and result.judge_failures == 0
            assert [r["step"] for r in result.records] == [0, 0, 1, 1]
            assert [r["target_style"] for r in result.records] == ["cute", "cute", "pirate", "pirate"]
            # The client waited for the learner's version 1 before step 1.
            assert {r["policy_version"] for r in result.records if r["step"] == 1} == {1}
            assert all(0.0 <= r["reward"] <= 1.0 for r in result.records)
            # The dashboard renders the learner's stored metrics in a real browser.
            async with httpx.AsyncClient(base_url=url) as http:
                data = (await http.get("/dashboard/data")).json()
                assert data["policy_version"] >= 1 and len(data["steps"]) >= 1
                r = await http.get("/admin/learner", headers=ADMIN)
                assert r.json()["steps"][0]["version"] == 1
                # Version 1 was trained from the base policy itself: KL(πθ ‖ π_ref) = 0 then.
                assert r.json()["steps"][0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
            dom = await asyncio.to_thread(chromium_dom, f"{url}/dashboard")
            assert f'id="policy-version">{data["policy_version"]}<' in dom, dom[:2000]
            assert 'id="learner-steps">' in dom and "no data yet" not in dom.split('id="c-reward"')[1][:400]
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 120)
        await policy_engine.swap(0, model_dir, weights_sha256(model_dir))
    out = tmp_path / "report"
    metrics = write_report(out, schedule, {"sao": result.records})
    saved = json.loads((out / "metrics.json").read_text())
    assert set(saved["methods"]["sao"]) >= {"auc", "last5_mean", "adaptation_lag", "style_share"}
    assert len(saved["methods"]["sao"]["adaptation_lag"]) == 1 and metrics["schedule"][0]["style"] == "cute"
    assert (out / "index.html").is_file()
