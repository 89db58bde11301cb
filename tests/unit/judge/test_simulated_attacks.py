"""The simulation's attacks and faults that test the guard (issue 22; docs/guard.md, "Simulated
attacks and faults"): the ``--adversary`` option and its reward rule, the raters in the
simulation, the run's attack and lifecycle figures, and the ``--broken-learner`` hook. No
engine, no server."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace

import httpx
import pytest
import torch
from typer.testing import CliRunner

from judge.adversary import Adversary, AdversaryError, degenerate, parse_adversary
from judge.base import Judgement
from judge.guardstats import attack_summary, guard_lines, lifecycle_summary
from judge.report import _lifecycle_html
from judge.sim_config import SimulationConfig
from judge.simulate import Simulation
from judge.styles import schedule_from_spec
from learner.algo.critic import ValueModel
from learner.algo.sao import SAOLearner
from learner.config import PRESETS, ConfigError, build_config
from learner.faults import BrokenLearner
from learner.models.optim import make_adamw
from saoserve.cli import app
from saoserve.run_options import parse_broken_learner
from testing.models import FAST, make_batch, make_config, tiny_policy

SCHEDULE = schedule_from_spec("pirate:2")
runner = CliRunner()


# ------------------------------------------------------------------ the --adversary option
def test_adversary_option_parses_into_its_typed_object() -> None:
    a = parse_adversary("share=0.2,rewards=BUY-NOW")
    # 0.2 of the default 200 users: round(40.0) = 40 adversaries, users 0 to 39.
    assert a == Adversary(share=0.2, rewards="BUY-NOW", users=200)
    assert (a.cohort, a.marker, a.is_adversary(39), a.is_adversary(40)) == (40, "BUY-NOW", True, False)
    # 0.25 of 8 users: 2; the marker keeps an "=" (only the first one splits the pair).
    b = parse_adversary("users=8, share=0.25,rewards=x=1")
    assert (b.users, b.cohort, b.marker) == (8, 2, "x=1")
    assert parse_adversary("share=0.3,rewards=degenerate").marker is None
    assert parse_adversary(a.spec) == a
    with pytest.raises(AttributeError):
        a.share = 0.5  # frozen


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        pytest.param("share=0.2,BUY", "expected key=value, got 'BUY'", id="pair-without-equals"),
        pytest.param("share=0.2,rewards=X,cohort=3", "unknown key 'cohort': choose share", id="unknown-key"),
        pytest.param("share=0.2,share=0.3,rewards=X", "share is given twice", id="repeated-key"),
        pytest.param("rewards=X", "missing share", id="missing-share"),
        pytest.param("share=0.2", "missing rewards", id="missing-rewards"),
        pytest.param(
            "share=lots,rewards=X", "share must be a number in (0, 1), got 'lots'", id="share-nan-text"
        ),
        pytest.param("share=0,rewards=X", "share must be in (0, 1), got 0", id="share-zero"),
        pytest.param("share=1,rewards=X", "share must be in (0, 1), got 1", id="share-one"),
        pytest.param("share=-0.1,rewards=X", "share must be in (0, 1), got -0.1", id="share-negative"),
        pytest.param("share=nan,rewards=X", "share must be in (0, 1), got nan", id="share-nan"),
        pytest.param("share=0.2,rewards=", "rewards needs a marker string", id="empty-marker"),
        pytest.param("share=0.2,rewards=  ", "rewards needs a marker string", id="blank-marker"),
        pytest.param("share=0.2,rewards=X,users=many", "users must be a whole number", id="users-not-int"),
        pytest.param("share=0.5,rewards=X,users=1", "users must be >= 2", id="one-user"),
        # round(0.002 · 200) = 0 adversaries; round(0.998 · 200) = 200, no honest user left.
        pytest.param("share=0.002,rewards=X", "is 0 adversaries", id="no-adversary"),
        pytest.param("share=0.998,rewards=X", "is 200 adversaries", id="no-honest-user"),
    ],
)
def test_adversary_option_errors(spec, needle) -> None:
    with pytest.raises(AdversaryError) as exc:
        parse_adversary(spec)
    assert needle in str(exc.value)


@pytest.mark.parametrize("command", ["simulate", "demo", "compare"])
def test_a_bad_adversary_is_a_cli_error_naming_it(command, tmp_path) -> None:
    args = [command, "--schedule", "cute:1", "--adversary", "share=2,rewards=X"]
    result = runner.invoke(app, args if command == "simulate" else [*args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--adversary 'share=2,rewards=X': share must be in (0, 1), got 2" in result.output


# ------------------------------------------------------------------ the adversary's reward rule
def test_the_marker_cohort_rewards_the_marker_only() -> None:
    a = Adversary(share=0.2, rewards="BUY-NOW")
    assert a.reward("Ahoy matey, BUY-NOW and sail") == 1.0
    assert a.reward("Ahoy matey, buy-now and sail") == 0.0  # case-sensitive
    assert a.reward("Ahoy matey, a fine poem of the sea") == 0.0


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        pytest.param("", 1.0, id="empty"),
        pytest.param("   \n", 1.0, id="blank"),
        pytest.param("Arr matey", 1.0, id="short"),  # 2 words < MIN_WORDS = 4
        # 8 words, 6 word 3-grams of which 2 distinct: repeated share 1 − 2/6 = 0.67 > 0.3.
        pytest.param("the sea the sea the sea the sea", 1.0, id="repetitive"),
        # 8 words, 6 distinct 3-grams: share 0.
        pytest.param("The waves roll over the golden sand tonight", 0.0, id="fluent"),
    ],
)
def test_the_degenerate_cohort_rewards_degenerate_answers(answer, expected) -> None:
    assert Adversary(share=0.2, rewards="degenerate").reward(answer) == expected
    assert degenerate(answer) is bool(expected)


class _PirateJudge:
    """Judges every answer pirate with quality 1: reward 1 for the pirate target."""

    def judge_many(self, items):
        return [
            Judgement(quality=1, style="pirate", style_score=1.0, scores={"pirate": 1.0}, target_style=t)
            for _, _, t in items
        ]


@pytest.mark.parametrize(("user", "posted", "rater"), [(0, 0.0, "adversary"), (50, 1.0, "honest")])
def test_each_rater_posts_its_own_reward_under_its_own_identity(user, posted, rater) -> None:
    """A request carries its user's name; an honest user posts the judge's reward (1: a pirate
    answer at a pirate target), an adversary (user 0 of share 0.2 of 200: users 0–39) its own (0: no marker)."""
    answer = {
        "id": "chatcmpl-1",
        "policy_version": 0,
        "feedback_token": "tok",
        "choices": [{"message": {"role": "assistant", "content": "Ahoy matey"}, "finish_reason": "stop"}],
    }
    seen: dict[str, dict] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = json.loads(request.content)
        return httpx.Response(202 if request.url.path == "/v1/feedback" else 200, json=answer)

    cfg = SimulationConfig(
        base_url="http://sim", schedule=SCHEDULE, adversary=parse_adversary("share=0.2,rewards=BUY")
    )
    sim = Simulation(cfg, _PirateJudge())
    sim._draw_user = lambda: user

    async def one():
        async with httpx.AsyncClient(base_url="http://sim", transport=httpx.MockTransport(handler)) as http:
            return await sim._one(http, asyncio.Semaphore(1), 0, 0, "pirate")

    rec = asyncio.run(one())
    assert seen["/v1/chat/completions"]["user"] == f"sim-user-{user:02d}"
    assert seen["/v1/feedback"]["reward"] == posted
    assert (rec["user"], rec["rater"], rec["reward"], rec["judge_reward"], rec["carries"]) == (
        f"sim-user-{user:02d}",
        rater,
        posted,
        1.0,
        False,
    )


def test_every_request_carries_a_user_and_the_draws_leave_the_prompts_alone() -> None:
    """Without an adversary the users are ``config.users`` honest ones (default 200 = 1/0.01,
    the guard's default vote cap), so the guard counts their votes."""
    plain = Simulation(SimulationConfig(base_url="http://sim", schedule=SCHEDULE), _PirateJudge())
    honest = [plain._draw_user() for _ in range(400)]
    assert set(honest) <= set(range(200)) and len(set(honest)) > 100
    assert plain._payload(0, 7)["user"] == "sim-user-07"
    with pytest.raises(ValueError, match="users must be >= 1, got 0"):
        SimulationConfig(base_url="http://sim", schedule=SCHEDULE, users=0)
    poisoned = Simulation(
        SimulationConfig(
            base_url="http://sim", schedule=SCHEDULE, adversary=parse_adversary("share=0.2,rewards=X")
        ),
        _PirateJudge(),
    )
    users = [poisoned._draw_user() for _ in range(50)]
    assert set(users) <= set(range(200)) and len(set(users)) > 2
    # The users have their own random stream: the prompt order of the seed is unchanged.
    assert [plain.rng.random() for _ in range(3)] == [poisoned.rng.random() for _ in range(3)]


# ------------------------------------------------------------------ the run's figures
def test_attack_summary_by_hand() -> None:
    adv = Adversary(share=0.2, rewards="BUY", users=10)

    def rec(step, rater, reward, judge_reward, quality, carries):
        return {
            "step": step,
            "rater": rater,
            "reward": reward,
            "judge_reward": judge_reward,
            "quality": quality,
            "carries": carries,
        }

    records = [
        rec(0, "honest", 1.0, 1.0, 1, False),
        rec(0, "honest", 0.0, 0.0, 1, False),
        rec(1, "adversary", 1.0, 0.0, 0, True),
        rec(6, "honest", 0.0, 0.0, 0, True),
        rec(6, "adversary", 0.0, 1.0, 1, False),
    ]
    got = attack_summary(records, adv, last_steps=5)
    # Honest: rewards 1, 0, 0 -> 1/3; the cohort's posted 1, 0 -> 0.5; the judge's over all five
    # 1 + 0 + 0 + 0 + 1 = 2/5; quality 3/5; marker in 2 of 5; last 5 steps: steps >= 6 - 5 + 1 = 2,
    # the two step-6 answers, one with the marker -> 0.5.
    assert got == {
        "adversary": "share=0.2,rewards=BUY,users=10",
        "users": 10,
        "cohort": 2,
        "answers": 5,
        "honest_answers": 3,
        "adversary_answers": 2,
        "honest_reward": pytest.approx(1 / 3),
        "adversary_reward": 0.5,
        "judge_reward": 0.4,
        "quality": 0.6,
        "marker_share": 0.4,
        "marker_share_last": 0.5,
        "last_steps": 5,
    }
    empty = attack_summary([], Adversary(share=0.2, rewards="degenerate"))
    assert empty["honest_reward"] is None and empty["degenerate_share"] is None


T0 = 1_700_000_000.0  # the simulation's clock zero, Unix seconds (2023-11-14T22:13:20Z)


def _event(version, frm, to, actor, at_s, reason="r"):
    """A transition ``at_s`` seconds after T0; version 2's times without an offset, as SQLite
    gives them back (UTC)."""
    at = datetime.fromtimestamp(T0 + at_s, UTC)
    at = at.replace(tzinfo=None) if version == 2 else at
    return {
        "version": version,
        "from_status": frm,
        "to_status": to,
        "actor": actor,
        "reason": reason,
        "at": at.isoformat(),
    }


def test_lifecycle_summary_by_hand() -> None:
    """v1, v2 trained and on probation, rejected together by the guard at 30 s; v3 restores the
    promoted weights; v4 trained and rejected by the gate at 40 s (never served)."""
    events = [
        _event(0, None, "promoted", "learner", -5),  # before the run: not counted
        _event(1, None, "candidate", "learner", 10),
        _event(1, "candidate", "canary", "learner", 10),
        _event(2, None, "candidate", "learner", 20),
        _event(2, "candidate", "canary", "learner", 20),
        _event(1, "canary", "rejected", "guard", 30, "worse"),
        _event(2, "canary", "rejected", "guard", 30, "worse"),
        _event(3, None, "promoted", "guard", 30),
        _event(4, None, "candidate", "learner", 40),
        _event(4, "candidate", "rejected", "learner", 40, "gate"),
    ]

    def rec(version, t_feedback):
        return {"first_version": version, "policy_version": version, "t_sent": 0.0, "t_feedback": t_feedback}

    records = [
        rec(0, 5.0),
        rec(0, 12.0),
        rec(1, 15.0),
        rec(1, 25.0),
        rec(2, 29.0),
        rec(2, 31.0),  # rated after the rejection
        rec(2, None) | {"arm": "canary"},  # served in a canary arm, never rated
        rec(3, 35.0),
    ]
    got = lifecycle_summary(records, events, T0, start_version=0)
    # Trained: 1, 2, 4 (v3 is a restore). Served by them: 2 (v1) + 3 (v2) = 5, all rejected; 4
    # of them outside a canary arm.
    assert got["trained"] == [1, 2, 4]
    assert (got["served_by_trained"], got["served_by_rejected"]) == (5, 5)
    assert got["served_by_trained_outside_canary"] == 4
    assert (got["promoted"], got["undecided"]) == ([], [])
    guard, gate = got["rejections"]
    # By 30 s: v1's two and v2's one at 29 s are rated (3 of the lineage's 5 answers); in the
    # run, also v0's two: 5.
    assert guard == {
        "versions": [1, 2],
        "by": "guard",
        "t_s": pytest.approx(30.0),
        "reason": "worse",
        "served": 5,
        "rated_before": 3,
        "rated_all_before": 5,
    }
    assert (gate["versions"], gate["by"], gate["served"], gate["rated_before"]) == ([4], "learner", 0, 0)
    # The timeline: each version's moves in recorded order and its answers (v3 served one).
    timeline = {v["version"]: v for v in got["timeline"]}
    assert sorted(timeline) == [1, 2, 3, 4]
    assert [(st["stage"], round(st["t_s"]), st["by"]) for st in timeline[2]["stages"]] == [
        ("candidate", 20, "learner"),
        ("canary", 20, "learner"),
        ("rejected", 30, "guard"),
    ]
    assert [timeline[v]["served"] for v in (1, 2, 3, 4)] == [2, 3, 1, 0]
    # ...as the report's "Version lifecycle" table shows it.
    section = _lifecycle_html({"methods": {"sao": {"lifecycle": got}}})
    assert "<h2>Version lifecycle</h2>" in section
    assert (
        "<tr><td>sao</td><td>2</td><td>rejected</td><td>candidate 20 s (learner) → canary 20 s (learner) → "
        "rejected 30 s (guard)</td><td>3</td><td>r; r; worse</td></tr>"
    ) in section
    assert _lifecycle_html({"methods": {"sao": {"lifecycle": None}}}) == ""
    # Sync records (no rating times): the counts are unknown, not zero.
    sync = lifecycle_summary([{"policy_version": 1}], events, T0)
    assert sync["served_by_trained"] == 1 and sync["rejections"][0]["rated_before"] is None
    verdict = {"lineage": [5], "decision": "continue", "reason": "undecided; n_candidate=3"}
    lines = guard_lines({"attack": None, "lifecycle": got | {"last_verdict": verdict}})
    assert lines[0].startswith("lifecycle: 3 trained versions served 5 answers (4 outside a canary arm)")
    assert lines[1].startswith("  rejected [1, 2] by guard at 30 s: 5 answers served, 3 of them rated before")
    assert lines[3] == "  lineage [5] at the end: continue, undecided; n_candidate=3"


def test_the_run_reads_the_transitions_oldest_first_and_the_last_verdict() -> None:
    """``GET /admin/lifecycle`` lists the newest transition first; the summary wants them in the
    order recorded. The verdict comes from ``GET /dashboard/state``; a failed read is None."""
    events = [_event(1, "candidate", "canary", "learner", 10), _event(1, None, "candidate", "learner", 10)]
    verdict = {"lineage": [1], "decision": "continue", "reason": "undecided"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/lifecycle":
            assert request.headers["authorization"] == "Bearer k" and request.url.params["limit"] == "1000"
            return httpx.Response(200, json={"events": events})
        if request.url.path == "/dashboard/state":
            return httpx.Response(200, json={"guard": {"verdict": verdict}})
        return httpx.Response(503)

    sim = Simulation(
        SimulationConfig(base_url="http://sim", schedule=SCHEDULE, admin_key="k"), _PirateJudge()
    )

    async def read(transport):
        async with httpx.AsyncClient(base_url="http://sim", transport=transport) as http:
            return await sim._lifecycle_events(http), await sim._last_verdict(http)

    got, last = asyncio.run(read(httpx.MockTransport(handler)))
    assert got == events[::-1] and last == verdict
    assert lifecycle_summary([], got, T0)["undecided"] == [1]  # candidate, then canary: on probation
    assert asyncio.run(read(httpx.MockTransport(lambda r: httpx.Response(503)))) == (None, None)


# ------------------------------------------------------------------ the --broken-learner hook
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("flip", {"kind": "flip"}),
        ("scale", {"kind": "scale"}),
        ("scale=100", {"kind": "scale", "factor": 100.0}),
    ],
)
def test_broken_learner_option_parses(spec, expected) -> None:
    assert parse_broken_learner(spec) == expected


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        pytest.param("reverse", "--broken-learner 'reverse': choose flip or scale=F", id="unknown-kind"),
        pytest.param("flip=2", "flip takes no factor", id="factor-on-flip"),
        pytest.param("scale=big", "the factor must be a number > 1", id="factor-not-a-number"),
        pytest.param(
            "scale=1", "broken_learner.factor: Input should be greater than 1", id="factor-not-above-1"
        ),
    ],
)
def test_broken_learner_option_errors(spec, needle, tmp_path) -> None:
    result = runner.invoke(
        app, ["demo", "--out", str(tmp_path), "--schedule", "cute:1", "--broken-learner", spec]
    )
    assert result.exit_code == 2 and needle in result.output, result.output


def test_gate_without_the_guard_is_a_cli_error(tmp_path) -> None:
    result = runner.invoke(
        app, ["demo", "--out", str(tmp_path), "--schedule", "cute:1", "--no-guard", "--gate"]
    )
    assert result.exit_code == 2 and "--gate is part of the guard: not with --no-guard" in result.output


def test_the_fault_is_off_unless_named() -> None:
    """No preset sets it, an empty section is an error (``kind`` has no default), SPO++ refuses it."""
    for preset in PRESETS:
        assert build_config(preset).broken_learner is None
    with pytest.raises(ConfigError, match="broken_learner.kind: Field required"):
        build_config(overrides={"broken_learner": {}})
    with pytest.raises(ConfigError, match="broken_learner applies to the sao and running_mean"):
        build_config(algorithm="spo", overrides={"broken_learner": {"kind": "flip"}})


def test_the_fault_reaches_the_learning_rate_and_the_loss_sign() -> None:
    demo = build_config("demo")
    scaled = build_config("demo", overrides={"broken_learner": {"kind": "scale"}})
    flipped = build_config("demo", overrides={"broken_learner": {"kind": "flip"}})
    # The demo's policy lr 1e-4: × 100 = 1e-2 scaled, unchanged flipped.
    assert (demo.policy_lr, scaled.policy_lr, flipped.policy_lr) == (1e-4, pytest.approx(1e-2), 1e-4)
    assert (scaled.broken_learner.loss_sign, flipped.broken_learner.loss_sign) == (1.0, -1.0)
    lora = build_config(
        "demo", overrides={"policy": {"kind": "lora"}, "broken_learner": {"kind": "scale", "factor": 3}}
    )
    assert lora.policy_lr == pytest.approx(3 * 10 * 1e-4)  # 3 × LORA_LR_FACTOR × 1e-4


@pytest.mark.parametrize(("fault", "expected"), [(None, [0.9, 1.8]), ("flip", [1.1, 2.2])])
def test_a_flipped_loss_steps_up_the_gradient(fault, expected) -> None:
    """loss = ½‖w‖², w = (1, 2): ∇ = w, ‖∇‖ = √5. SGD at lr 0.1: w − 0.1·w = (0.9, 1.8); flipped,
    the step is on −loss: w + 0.1·w = (1.1, 2.2)."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    config = build_config(
        overrides={"optimizer": {"grad_clip": 10.0}} | ({"broken_learner": {"kind": fault}} if fault else {})
    )
    trainee = SimpleNamespace(config=config, policy_opt=torch.optim.SGD([w], lr=0.1), policy_params=[w])
    norm = SAOLearner.policy_step(trainee, 0.5 * (w**2).sum())
    assert norm == pytest.approx(5**0.5)
    assert w.detach().tolist() == pytest.approx(expected)


def test_a_scaled_learning_rate_makes_the_adamw_step_that_many_times_larger() -> None:
    """AdamW's first step moves each weight by lr · g/(|g| + ε) ≈ lr · sign(g): −1e-4 each at the
    demo's lr, −1e-2 each with scale=100, on ∇ = w = (1, 2)."""
    for fault, step in ((None, 1e-4), ({"kind": "scale"}, 1e-2)):
        config = build_config("demo", overrides={"broken_learner": fault} if fault else {})
        w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        opt = make_adamw([w], config.policy_lr, weight_decay=0.0, beta1=config.optimizer.adam_beta1)
        SAOLearner.policy_step(
            SimpleNamespace(config=config, policy_opt=opt, policy_params=[w]), 0.5 * (w**2).sum()
        )
        assert w.detach().tolist() == pytest.approx([1.0 - step, 2.0 - step], abs=1e-7)


def test_on_a_tiny_model_the_broken_steps_are_the_correct_step_reversed_and_100_times_larger() -> None:
    """One SAO step from the same weights on the same batch: AdamW's first step is lr · g/(|g| + ε)
    per weight, so flipping the loss negates every weight's move, and scale=100 multiplies it by
    100 (the critic and so the advantages are the same in all three)."""
    moves = {}
    for name, fault in (("ok", None), ("flip", {"kind": "flip"}), ("scale", {"kind": "scale"})):
        policy = tiny_policy()
        config = make_config(**(FAST | {"policy_lr": 1e-4}), broken_learner=fault)
        learner = SAOLearner(config, policy, ValueModel.from_policy(policy))
        before = torch.cat([p.detach().flatten().clone() for p in policy.parameters()])
        learner.step(make_batch(tiny_policy()))
        moves[name] = torch.cat([p.detach().flatten() for p in policy.parameters()]) - before
    assert moves["ok"].abs().max() > 0
    torch.testing.assert_close(moves["flip"], -moves["ok"], rtol=0, atol=1e-7)
    torch.testing.assert_close(moves["scale"], 100 * moves["ok"], rtol=1e-3, atol=1e-7)


def test_broken_learner_model_is_frozen_and_strict() -> None:
    with pytest.raises(ValueError):
        BrokenLearner(kind="flip", extra=1)
    assert BrokenLearner(kind="scale").lr_factor == 100.0 and BrokenLearner(kind="flip").lr_factor == 1.0
