"""Command-line errors name the problem and exit 2 (no engine)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from saoserve.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    from core.settings import get_settings

    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["learn", "--estimator", "ppo"], "unknown algorithm 'ppo': choose sao, running_mean, spo"),
        (["learn", "--algorithm", "ppo"], "unknown algorithm 'ppo'"),
        (
            ["learn", "--critic-trainable", "attn"],
            "algorithm.sao.critic_trainable: Input should be 'mlp' or 'all'",
        ),
        (["learn", "--gae-mode", "steps"], "algorithm.sao.gae_mode: Input should be 'token'"),
        (["learn", "--estimator", "spo", "--kl-coef", "0.1"], "kl_coef does not apply to the spo algorithm"),
        (
            ["learn", "--algorithm", "running_mean", "--critic-lr", "0.1"],
            "critic_lr does not apply to the running_mean",
        ),
        (["learn", "--preset", "fast"], "unknown preset 'fast': choose paper, cpu, demo"),
        (["learn", "--batch-size", "0"], "batch_size: Input should be greater than or equal to 1"),
        (["learn", "--eps-low", "2"], "algorithm.sao.eps_low: Input should be less than or equal to 1"),
        (["learn", "--config", "/no/such/learner.json"], "cannot read the config /no/such/learner.json"),
        (
            ["learn", "--correction", "vtrace"],
            "unknown correction 'vtrace': choose dis, mis_snapshot, mis_ewma",
        ),
        (
            ["learn", "--estimator", "spo", "--correction", "mis_ewma"],
            "the mis_ewma correction applies to the sao",
        ),
        (["learn", "--epochs", "2"], "epochs does not apply to the dis correction"),
        (["learn", "--correction", "mis_snapshot", "--window", "0"], "correction.mis_snapshot.window"),
        (["evidence-init", "/no/such/file.jsonl"], "does not exist"),
        (["simulate", "--schedule", "cute:0"], "need >= 1"),
        (["simulate", "--schedule", "sparkly:3"], "unknown style 'sparkly'"),
        (["simulate", "--judge", "oracle", "--schedule", "cute:1"], "unknown judge 'oracle'"),
        (["simulate", "--steps", "0"], "Invalid value for '--steps'"),
        (["simulate", "--tenant", "Acme!"], "--tenant: tenant 'Acme!' is not a valid name"),
        (["simulate", "--tenant", "acme"], "--tenant needs --api-key"),
        (["demo", "--critic-init", "/no/such/critic.pt"], "--critic-init /no/such/critic.pt is not a file"),
        (["compare", "--methods", "sao,ppo"], "--methods: unknown method 'ppo': choose sao, running_mean"),
        (["compare", "--methods", " , "], "--methods ' , ': name at least one of sao, running_mean"),
        (["demo", "--methods", "sao,sao"], "--methods 'sao,sao': a method is named twice"),
        (
            ["demo", "--advantage-values", "before"],
            "algorithm.sao.advantage_values: Input should be 'after_updates' or 'before_updates'",
        ),
        (
            ["compare", "--critic-init", "/no/such/critic.pt"],
            "--critic-init /no/such/critic.pt is not a file",
        ),
    ],
)
def test_cli_errors(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_serve_needs_feedback_secret(monkeypatch):
    monkeypatch.delenv("SAOSERVE_FEEDBACK_SECRET", raising=False)
    result = runner.invoke(app, ["serve", "--port", "8999"])
    assert result.exit_code == 2 and "SAOSERVE_FEEDBACK_SECRET" in result.output


def test_llm_judge_needs_settings(monkeypatch):
    monkeypatch.delenv("SAOSERVE_JUDGE_URL", raising=False)
    result = runner.invoke(app, ["simulate", "--judge", "llm", "--schedule", "cute:1"])
    assert result.exit_code == 2 and "SAOSERVE_JUDGE_URL" in result.output


def test_judge_settings_are_separate(monkeypatch, tmp_path):
    """SAOSERVE_JUDGE_MODEL names the LLM judge's model only; the offline judge's embedding
    folder is SAOSERVE_JUDGE_EMBEDDING_DIR (setting one used to break the other)."""
    from core.settings import get_settings
    from saoserve.run_options import make_judge as _judge

    monkeypatch.setenv("SAOSERVE_JUDGE_MODEL", "gpt-judge")
    get_settings.cache_clear()
    assert _judge("offline").model_path is None  # the shipped package, not "gpt-judge"
    monkeypatch.setenv("SAOSERVE_JUDGE_URL", "http://127.0.0.1:9/v1")
    get_settings.cache_clear()
    assert _judge("llm").model == "gpt-judge"
    monkeypatch.setenv("SAOSERVE_JUDGE_EMBEDDING_DIR", str(tmp_path / "minilm"))
    get_settings.cache_clear()
    assert _judge("offline").model_path == str(tmp_path / "minilm")


def test_evidence_init_bad_line_names_it(home):
    f = home / "rollouts.jsonl"
    f.write_text('{"prompt_id": "a", "reward": 1}\n{"prompt_id": "a", "reward": 7}\n')
    result = runner.invoke(app, ["evidence-init", str(f)])
    assert result.exit_code == 2 and ":2" in result.output


def test_evidence_init_and_pretrain_on_empty_log(home):
    f = home / "rollouts.jsonl"
    # 3 successes of 8 for prompt a → Jeffreys α0 = 8·3.5/9 ≈ 3.111.
    f.write_text("".join(f'{{"prompt_id": "a", "reward": {int(i < 3)}}}\n' for i in range(8)))
    result = runner.invoke(app, ["evidence-init", str(f)])
    assert result.exit_code == 0 and "1 prompts" in result.output
    from core.db import make_engine
    from core.evidence_store import EvidenceStore, stored_prompt_id
    from core.settings import get_settings

    # "a" is a client's id: stored under its keyed hash (core.evidence_store.stored_prompt_id).
    settings = get_settings()
    stored = stored_prompt_id(settings.feedback_secret, "a")
    base = EvidenceStore(make_engine(settings.resolved_database_url)).read(stored, 0)
    assert base.alpha == pytest.approx(8 * 3.5 / 9) and base.beta == pytest.approx(8 - 8 * 3.5 / 9)
    result = runner.invoke(app, ["pretrain-critic"])
    assert result.exit_code == 2 and "no trajectory with feedback" in result.output


def test_learn_maps_its_options_onto_one_config(monkeypatch, tmp_path):
    """Preset, then a JSON file, each overridden by the options given; the learner gets the result."""
    import learner.process
    import saoserve.model
    from learner.config import build_config

    seen = []
    monkeypatch.setattr(learner.process, "run_learner", lambda settings, config: seen.append(config))
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    args = ["learn", "--preset", "demo", "--correction", "mis_ewma", "--no-ewma-reset", "--window", "2"]
    result = runner.invoke(app, [*args, "--minibatches", "4", "--kl-coef", "0.2", "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    want = build_config(
        "demo",
        correction="mis_ewma",
        overrides={
            "max_steps": 3,
            "algorithm": {"kl_coef": 0.2},
            "correction": {"reset": False, "window": 2, "minibatches": 4},
        },
    )
    assert seen == [want] and want.batch_size == 16 and want.correction.reset is False
    path = tmp_path / "learner.json"
    path.write_text(want.to_json())
    result = runner.invoke(
        app, ["learn", "--config", str(path), "--estimator", "running_mean", "--batch-size", "4"]
    )
    assert result.exit_code == 0, result.output
    assert seen[1].algorithm.name == "running_mean" and seen[1].algorithm.kl_coef == 0.2
    assert seen[1].batch_size == 4 and seen[1].correction == want.correction


@pytest.mark.parametrize("command", ["demo", "compare"])
def test_learning_rates_reach_the_learner(monkeypatch, tmp_path, command):
    """--policy-lr/--critic-lr/--advantage-values/--adam-beta1/--kl-coef/--correction become each
    method's learner config (the critic's options only where the method has a critic)."""
    import saoserve.demo
    import saoserve.model
    from judge.sim_result import SimulationResult

    seen: list = []

    def fake_run_method(method, schedule, judge, out, **kw):
        seen.append((method, kw["learner_config"]))
        assert kw["keep_weights"] is False
        return SimulationResult()

    monkeypatch.setattr(saoserve.demo, "run_method", fake_run_method)
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    result = runner.invoke(
        app,
        [
            command,
            "--out",
            str(tmp_path / "report"),  # not the default ./report: the test leaves the checkout alone
            "--schedule",
            "cute:1",
            "--policy-lr",
            "0.0003",
            "--critic-lr",
            "0.0007",
            "--advantage-values",
            "before_updates",
            "--adam-beta1",
            "0.5",
            "--kl-coef",
            "0.05",
            "--correction",
            "mis_ewma",
        ],
    )
    # No step ran, so there is nothing to report: a CLI error, after the runs were started.
    assert result.exit_code == 2 and "no step completed" in result.output
    assert [m for m, _ in seen] == (["sao"] if command == "demo" else ["sao", "running_mean"])
    for method, config in seen:
        assert config.algorithm.name == method and config.correction.kind == "mis_ewma"
        opt = config.optimizer
        assert (config.batch_size, opt.policy_lr, opt.adam_beta1) == (16, 0.0003, 0.5)
        assert config.algorithm.kl_coef == 0.05
        assert getattr(config.algorithm, "critic_lr", None) == (0.0007 if method == "sao" else None)
        want = "before_updates" if method == "sao" else None
        assert getattr(config.algorithm, "advantage_values", None) == want


@pytest.mark.parametrize("command", ["demo", "compare"])
def test_demo_and_compare_default_to_the_demo_preset(monkeypatch, tmp_path, command):
    """Without learner options each method runs the ``demo`` preset as it stands in
    learner.config (batch 16, policy lr 1e-4, β1 0.5, critic lr 2e-4 and KL 0.04 where the
    method has them): the preset is the only place those defaults are written."""
    import saoserve.demo
    import saoserve.model
    from judge.sim_result import SimulationResult
    from learner.config import build_config

    seen: list = []

    def fake_run_method(method, schedule, judge, out, **kw):
        seen.append((kw["learner_config"], kw["batch_size"]))
        return SimulationResult()

    monkeypatch.setattr(saoserve.demo, "run_method", fake_run_method)
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    result = runner.invoke(app, [command, "--out", str(tmp_path / "r"), "--schedule", "cute:1"])
    assert result.exit_code == 2 and "no step completed" in result.output
    methods = ["sao"] if command == "demo" else ["sao", "running_mean"]
    assert seen == [(build_config("demo", algorithm=m), 16) for m in methods]


@pytest.mark.parametrize(
    ("command", "spec", "want"),
    [
        ("compare", "running_mean", ["running_mean"]),
        ("compare", " running_mean , sao ", ["running_mean", "sao"]),
        ("demo", "sao,running_mean", ["sao", "running_mean"]),
    ],
)
def test_methods_choose_what_runs(monkeypatch, tmp_path, command, spec, want):
    """--methods runs the named methods in the given order, each with the demo preset."""
    import saoserve.demo
    import saoserve.model
    from judge.sim_result import SimulationResult
    from learner.config import build_config

    seen: list = []

    def fake_run_method(method, schedule, judge, out, **kw):
        seen.append((method, kw["learner_config"]))
        return SimulationResult()

    monkeypatch.setattr(saoserve.demo, "run_method", fake_run_method)
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    args = [command, "--out", str(tmp_path / "r"), "--schedule", "cute:1", "--methods", spec]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "no step completed" in result.output
    assert seen == [(m, build_config("demo", algorithm=m)) for m in want]


def test_demo_run_starts_the_learner_with_its_config_file(monkeypatch, tmp_path):
    """run_method writes <home>/learner.json (with the batch size and the step limit: the
    schedule's 4 steps are served by versions 0..3, so 3 steps) and spawns `learn --config` it."""
    import saoserve.demo
    from judge.styles import schedule_from_spec
    from learner.config import build_config, load_config

    started = []

    class FakeServices:
        def __init__(self, home, learn_args, log_dir):
            started.append(learn_args)

        def start(self):
            raise RuntimeError("no server in this test")

    monkeypatch.setattr(saoserve.demo, "Services", FakeServices)
    config = build_config("demo", algorithm="running_mean", correction="mis_snapshot")
    with pytest.raises(RuntimeError, match="no server"):
        saoserve.demo.run_method(
            "running_mean",
            schedule_from_spec("cute:4", 1),
            None,
            tmp_path,
            batch_size=4,
            learner_config=config,
        )
    path = tmp_path / "run-running_mean" / "learner.json"
    assert started == [["--config", str(path)]]
    assert load_config(path) == build_config(
        "demo",
        algorithm="running_mean",
        correction="mis_snapshot",
        overrides={"batch_size": 4, "max_steps": 3},
    )


def test_drop_weights_keeps_the_report_data(tmp_path):
    """A finished demo deletes versions and checkpoint (3 + 5 + 7 bytes here), nothing else."""
    from saoserve.demo import drop_weights

    pol = tmp_path / "policies"
    (pol / "v000001").mkdir(parents=True)
    (pol / "v000001" / "model.safetensors").write_bytes(b"abc")
    (pol / "v000002").mkdir()
    (pol / "v000002" / "model.safetensors").write_bytes(b"abcde")
    (pol / "checkpoint.pt").write_bytes(b"1234567")
    (pol / "critic_pretrained.pt").write_bytes(b"keep")
    (tmp_path / "saoserve.db").write_bytes(b"db")
    assert drop_weights(tmp_path) == 3 + 5 + 7
    assert sorted(p.name for p in pol.iterdir()) == ["critic_pretrained.pt"]
    assert (tmp_path / "saoserve.db").read_bytes() == b"db"


def test_a_pretrained_critic_goes_where_the_learner_loads_it(tmp_path):
    """``--critic-init``: the file is copied byte for byte to ``<home>/policies/critic_pretrained.pt``
    (the name ``SAOAlgorithm.warm_start`` reads); a missing file is an error, not a fresh critic."""
    from learner.algo.pretrain import PRETRAINED_CRITIC
    from saoserve.demo import place_pretrained_critic

    src = tmp_path / "critic.pt"
    src.write_bytes(b"state")
    home = tmp_path / "run-sao"
    placed = place_pretrained_critic(home, src)
    assert placed == home / "policies" / PRETRAINED_CRITIC and placed.read_bytes() == b"state"
    with pytest.raises(FileNotFoundError, match="no pretrained critic at"):
        place_pretrained_critic(home, tmp_path / "missing.pt")


def test_an_interrupted_run_ends_the_comparison_with_a_partial_report(monkeypatch, tmp_path):
    """Seeds 0..1 of sao and running_mean run in the order sao-s0, running_mean-s0, sao-s1, ...;
    when running_mean-s0 is interrupted, nothing more starts and the report holds sao-s0 alone."""
    import saoserve.demo
    import saoserve.model
    from judge.sim_result import SimulationResult
    from judge.styles import schedule_from_spec
    from learner.config import build_config

    started: list[str] = []

    def fake_run_method(method, schedule, judge, out, **kw):
        started.append(kw["name"])
        if method == "running_mean":
            return SimulationResult(interrupted=True, stopped_by="saoserve learn exited (exit code 1)")
        rec = {"step": 0, "target_style": "cute", "detected_style": "cute", "reward": 1.0}
        return SimulationResult(records=[rec])

    monkeypatch.setattr(saoserve.demo, "run_method", fake_run_method)
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    (tmp_path / "model").mkdir()
    configs = {m: build_config("demo", algorithm=m) for m in ("sao", "running_mean")}
    metrics = saoserve.demo.run_methods(
        configs,
        schedule_from_spec("cute:1"),
        None,
        tmp_path / "report",
        tmp_path / "model",
        batch_size=1,
        max_tokens=8,
        seed=0,
        seeds=2,
        window=1,
        threshold=0.4,
    )
    assert started == ["sao-s0", "running_mean-s0"]
    assert list(metrics["methods"]) == ["sao"] and metrics["methods"]["sao"]["auc"] == 1.0
    assert (tmp_path / "report" / "index.html").is_file()
    assert (tmp_path / "report" / "run-sao-s0" / "model").resolve() == (tmp_path / "model").resolve()


@pytest.mark.parametrize(("args", "total"), [(["--steps", "2"], 2), ([], 3)])
def test_simulate_steps_stops_before_the_schedule_ends(monkeypatch, tmp_path, args, total):
    """``--steps 2`` on ``pirate:2,poetic:1`` runs steps 0-1 (both judged for pirate, the
    poetic step never comes); without it the run covers the schedule's 2 + 1 = 3 steps."""
    import judge.sim_result
    import judge.simulate
    import saoserve.run_commands

    seen = []

    class FakeSimulation:
        def __init__(self, config, judge, on_step=None):
            seen.append(config)

        async def run(self):
            return judge.sim_result.SimulationResult()

    monkeypatch.setattr(judge.simulate, "Simulation", FakeSimulation)
    monkeypatch.setattr(saoserve.run_commands, "make_judge", lambda kind: None)
    result = runner.invoke(
        app, ["simulate", "--schedule", "pirate:2,poetic:1", "--out", str(tmp_path / "r"), *args]
    )
    assert result.exit_code == 0, result.output
    assert seen[0].total_steps == total
    assert [seen[0].schedule.target_at(s) for s in range(total)] == ["pirate", "pirate", "poetic"][:total]


@pytest.mark.parametrize("variable", ["SAOSERVE_ENGINE_THREADS", "SAOSERVE_LEARNER_THREADS"])
@pytest.mark.parametrize("command", [["serve", "--port", "8999"], ["learn"]])
def test_thread_counts_below_one_are_refused(monkeypatch, capsys, variable, command):
    import sys

    from saoserve.cli import main

    monkeypatch.setenv("SAOSERVE_FEEDBACK_SECRET", "s")
    monkeypatch.setenv(variable, "0")
    monkeypatch.setattr(sys, "argv", ["saoserve", *command])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"error: invalid settings: {variable}: Input should be greater than or equal to 1\n"
    )


def test_a_learner_config_file_is_laid_over_the_demo_preset(monkeypatch, tmp_path):
    """--learner-config: the file's fields over the demo preset, the options over the file (its
    policy lr 5e-4 loses to --policy-lr 3e-4); the preset's other fields stay (batch 16, β1 0.5)."""
    import saoserve.demo
    import saoserve.model
    from judge.sim_result import SimulationResult

    seen: list = []

    def fake_run_method(method, schedule, judge, out, **kw):
        seen.append(kw["learner_config"])
        return SimulationResult()

    monkeypatch.setattr(saoserve.demo, "run_method", fake_run_method)
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    path = tmp_path / "lora.json"
    fields = {"optimizer": {"policy_lr": 5e-4}, "policy": {"kind": "lora", "rslora": True, "b_lr_ratio": 16}}
    path.write_text(json.dumps(fields))
    args = ["demo", "--out", str(tmp_path / "r"), "--schedule", "cute:1", "--learner-config", str(path)]
    result = runner.invoke(app, [*args, "--policy-lr", "3e-4"])
    assert result.exit_code == 2 and "no step completed" in result.output
    (config,) = seen
    assert config.policy.kind == "lora" and config.policy.rslora and config.policy.b_lr_ratio == 16
    assert (config.optimizer.policy_lr, config.optimizer.adam_beta1, config.batch_size) == (3e-4, 0.5, 16)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "cannot read the config"),
        ("[1, 2]", "a config is a JSON object"),
        ('{"policy": {"kind": "lora", "b_lr_ratio": 0}}', "b_lr_ratio"),
        ('{"policy": "lora"}', 'policy is a JSON object of its fields, not "lora"'),
    ],
    ids=["not-json", "not-an-object", "bad-field", "section-not-an-object"],
)
def test_a_bad_learner_config_file_is_a_named_cli_error(tmp_path, text, error):
    path = tmp_path / "bad.json"
    path.write_text(text)
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "r"), "--learner-config", str(path)])
    assert result.exit_code == 2 and error in result.output, result.output


def test_a_missing_learner_config_file_is_a_named_cli_error(tmp_path):
    result = runner.invoke(
        app, ["demo", "--out", str(tmp_path / "r"), "--learner-config", str(tmp_path / "no.json")]
    )
    assert result.exit_code == 2 and "cannot read the config" in result.output, result.output
