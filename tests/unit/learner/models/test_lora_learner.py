"""LoRA policies in the learner (issue 20; learner.models.lora, docs/lora.md): only the adapter trains, the
KL reference is the adapter switched off, versions publish PEFT's layout, checkpoints round-trip.

Tiny random Llamas (tests.test_sao_step.tiny_policy; testing.learner for the process);
no engine.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from sqlalchemy import select
from typer.testing import CliRunner

from core.control import ROLLBACK_TO, set_flag
from core.db import PolicyVersion
from core.logbus import open_log
from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE, CHECKPOINT_FILE, Layout, layout
from core.weights import weights_sha256
from learner.algo.critic import ValueModel
from learner.algo.old_logits import SnapshotOldPolicy
from learner.algo.sao import SAOLearner
from learner.algo.spo import SPOLearner
from learner.config import ConfigError, LoraPolicy, build_config
from learner.data.batch import policy_logprobs
from learner.models.lora import Adapter
from learner.process import Learner
from testing.learner import feed, in_process
from testing.models import FAST, make_batch, make_config, tiny_policy

RANK = 2
LORA = {"kind": "lora", "rank": RANK}
# The tiny Llama: hidden 32, intermediate 64, 4 heads of 8, 2 KV heads (k/v out 16), 2 layers.
# r·(in + out) per projection: q, o 2·64; k, v 2·48; gate, up, down 2·96 → 2·(128 + 96 + 288)
# = 1024 per layer, 2048 in all.
ADAPTER_NUMEL = 2048


def lp(model, batch):
    mask = batch.action_mask.bool()
    with torch.no_grad():
        return policy_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.temperatures, positions=mask
        )


def sao(bf16: bool = False, kl_coef: float = 0.1, **fields) -> SAOLearner:
    policy = tiny_policy()
    critic = ValueModel.from_policy(policy)
    return SAOLearner(make_config(**FAST, kl_coef=kl_coef, bf16=bf16, policy=LORA, **fields), policy, critic)


def spo(bf16: bool = False) -> SPOLearner:
    return SPOLearner(make_config("spo", policy_lr=1e-2, bf16=bf16, policy=LORA), tiny_policy())


def spo_batch(policy):
    batch = make_batch(policy)
    batch.baseline_values = torch.full((4,), 0.5)
    return batch


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sao", "spo"])
def test_only_the_adapter_trains_and_the_base_weights_stay_bit_identical(kind, bf16):
    learner = sao(bf16) if kind == "sao" else spo(bf16)
    batch = make_batch(tiny_policy()) if kind == "sao" else spo_batch(tiny_policy())
    named = dict(learner.policy.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    trained = {n for n, p in named.items() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(named[n].numel() for n in trained) == learner.adapter.numel() == ADAPTER_NUMEL
    # The optimizer holds the adapter only: its masters (bf16) or its parameters (float32).
    groups = learner.policy_opt.param_groups
    assert sum(p.numel() for g in groups for p in g["params"]) == ADAPTER_NUMEL
    # LoRA's rate: 10 × the full one (FAST policy_lr 1e-2).
    assert learner.config.policy_lr == pytest.approx(0.1) and groups[0]["lr"] == pytest.approx(0.1)
    learner.step(batch)
    for n, p in named.items():
        if n in trained:
            continue
        assert p.grad is None and torch.equal(p.detach(), before[n]), n
    # B moved from 0 (it gets A's gradient at once); A moves once B is non-zero: both after 2 steps.
    learner.step(batch)
    changed = {n for n in trained if not torch.equal(named[n].detach(), before[n])}
    assert changed == trained
    expected_dtype = torch.bfloat16 if bf16 else torch.float32
    assert {named[n].dtype for n in trained} == {expected_dtype}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_lora_plus_gives_b_its_own_rate(bf16):
    """LoRA+ (b_lr_ratio 4, lr 0.01): two parameter groups, A at 0.01 and B at 0.04. At the first
    step B = 0, so A's gradient Bᵀ·(∂L/∂(BAx))·xᵀ is 0 and A stays; Adam's first update is
    lr · m̂/(√v̂ + ε) = lr · g/(|g| + ε), so every B entry with |g| ≫ ε = 1e-8 moves by 0.04."""
    policy = tiny_policy()
    lora = {"kind": "lora", "rank": RANK, "lr": 0.01, "b_lr_ratio": 4.0}
    config = make_config(**FAST, kl_coef=0.1, bf16=bf16, policy=lora)
    learner = SAOLearner(config, policy, ValueModel.from_policy(policy))
    groups = learner.policy_opt.param_groups
    assert [g["lr"] for g in groups] == [pytest.approx(0.01), pytest.approx(0.04)]
    assert [sum(p.numel() for p in g["params"]) for g in groups] == [
        sum(p.numel() for n, p in learner.policy.named_parameters() if ".lora_A." in n),
        sum(p.numel() for n, p in learner.policy.named_parameters() if ".lora_B." in n),
    ]
    named = {n: p for n, p in learner.policy.named_parameters() if p.requires_grad}
    before = {n: p.detach().float().clone() for n, p in named.items()}
    learner.step(make_batch(tiny_policy()))
    moved = {n: (p.detach().float() - before[n]).abs() for n, p in named.items()}
    assert all(torch.equal(moved[n], torch.zeros_like(moved[n])) for n in named if ".lora_A." in n)
    b_steps = torch.cat([moved[n].flatten() for n in named if ".lora_B." in n])
    # bf16 rounds 0.04 to the nearest of its 8 significant bits: 0.0400390625.
    assert b_steps.max().item() == pytest.approx(0.04, rel=2e-3)
    assert (b_steps > 0.035).float().mean().item() > 0.9


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(tmp_path):
    """rsLoRA: α/√r = 32/√2 = 22.627 instead of α/r = 16, in the learner's layers and in the
    published adapter_config.json (which the servers read: tests/unit/server/test_adapter_serving.py)."""
    adapter = Adapter(tiny_policy(), LoraPolicy(rank=RANK, rslora=True))
    scales = {m.scaling["default"] for m in adapter.peft.modules() if isinstance(m, LoraLayer)}
    assert len(scales) == 1 and scales.pop() == pytest.approx(22.627417)
    folder = tmp_path / "v1"
    adapter.save(folder, torch.float32)
    assert json.loads((folder / ADAPTER_CONFIG).read_text())["use_rslora"] is True


def test_kl_reference_is_the_policy_with_its_adapter_off():
    learner = sao()
    base = tiny_policy()
    batch = make_batch(base)
    anchor = learner.policy_update.anchor
    assert anchor.reference is learner.policy and anchor.shares_policy
    # At init B = 0: πθ = π_ref token for token, so every d = 0 and k3 = expm1(0) − 0 = 0 exactly.
    metrics = learner.step(batch)
    assert metrics["kl_ref"] == 0.0
    learner.step(batch)
    ref = anchor.reference_logprobs(learner.logprobs, batch, batch.action_mask.bool())
    # The adapter off computes the base layers alone: bit-identical to the untouched base model;
    # the adapted policy has moved away from it.
    assert torch.equal(ref, lp(base, batch))
    assert not torch.equal(lp(learner.policy, batch), ref)


def test_build_loads_no_reference_model_with_lora():
    calls = []

    def load():
        calls.append(1)
        return tiny_policy()

    config = make_config(**FAST, kl_coef=0.1, policy=LORA)
    learner = SAOLearner.build(config, load)
    assert len(calls) == 1 and learner.policy_update.anchor.reference is learner.policy
    assert not any(isinstance(m, Adapter) for m in learner.critic.modules())
    assert not any("lora_" in n for n, _ in learner.critic.named_parameters())
    full = SAOLearner.build(make_config(**FAST, kl_coef=0.1), load)
    assert len(calls) == 3 and full.policy_update.anchor.reference is not full.policy


def test_a_reference_model_is_refused_with_lora():
    policy = tiny_policy()
    with pytest.raises(ValueError, match="reference=None"):
        SAOLearner(
            make_config(kl_coef=0.1, policy=LORA), policy, ValueModel.from_policy(policy), tiny_policy()
        )


def test_published_adapter_is_peft_layout_and_reloads_to_the_same_logprobs(tmp_path):
    learner = sao()
    batch = make_batch(tiny_policy())
    learner.step(batch)
    learner.step(batch)
    folder = tmp_path / "v000001"
    learner.adapter.save(folder, torch.float32)
    assert layout(folder) == Layout.ADAPTER
    assert sorted(p.name for p in folder.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG, "README.md"])
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, 32.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(LoraPolicy().target_modules)
    # Byte for byte what PeftModel.save_pretrained writes for the same adapter.
    learner.adapter.peft.save_pretrained(tmp_path / "peft")
    assert (folder / ADAPTER_FILE).read_bytes() == (tmp_path / "peft" / ADAPTER_FILE).read_bytes()
    # The model PEFT wraps computes with the loaded adapter (policy_logprobs takes a plain LM).
    reloaded = PeftModel.from_pretrained(tiny_policy(), folder).eval().get_base_model()
    diff = (lp(reloaded, batch) - lp(learner.policy, batch)).abs().max().item()
    assert diff < 1e-5


def test_merged_weights_compute_what_the_adapter_model_does():
    learner = sao()
    batch = make_batch(tiny_policy())
    learner.step(batch)
    learner.step(batch)
    merged = tiny_policy()
    assert merged.load_state_dict(learner.adapter.merged_weights(), strict=False).unexpected_keys == []
    # W + (α/r)·B·A by hand for one projection: α/r = 32/2 = 16.
    layer = learner.adapter.peft.base_model.model.model.layers[0].self_attn.q_proj
    by_hand = layer.base_layer.weight + 16.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(merged.model.layers[0].self_attn.q_proj.weight, by_hand)
    assert (lp(merged, batch) - lp(learner.policy, batch)).abs().max().item() < 1e-5


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_checkpoint_round_trips_and_holds_the_adapter_only(bf16):
    learner = sao(bf16)
    batch = make_batch(tiny_policy())
    learner.step(batch)
    state = copy.deepcopy(learner.state_dict())
    assert all("lora_" in k for k in state["policy"]) and len(state["policy"]) == 2 * 7 * 2
    again = sao(bf16)
    again.load_state_dict(state)
    assert torch.equal(lp(again.policy, batch), lp(learner.policy, batch))
    m1, m2 = learner.step(batch), again.step(batch)
    assert m1["policy_loss"] == m2["policy_loss"]
    for (n, p), q in zip(learner.policy.named_parameters(), again.policy.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_reset_to_base_gives_the_base_logprobs_and_a_full_state_is_refused():
    learner = spo()
    batch = spo_batch(tiny_policy())
    learner.step(batch)
    learner.reset_policy_to_base()
    assert torch.equal(lp(learner.policy, batch), lp(tiny_policy(), batch))
    with pytest.raises(ValueError, match="adapter state mismatch"):
        learner.load_policy_weights(tiny_policy().state_dict())


def test_snapshots_keep_the_adapter_only():
    learner = sao()
    store = SnapshotOldPolicy(learner.policy, window=3)
    for v in range(5):
        store.on_version(v, learner.policy)
    # W + 1 = 4 versions × 2048 float32 adapter tensors × 4 bytes.
    assert store.nbytes() == 4 * ADAPTER_NUMEL * 4


def test_lora_config_errors_are_named():
    for fields, message in (
        ({"kind": "lora", "rank": 0}, "policy.lora.rank: Input should be greater than or equal to 1"),
        ({"kind": "lora", "target_modules": ["q_proj", "qkv"]}, "policy.lora.target_modules.1"),
        ({"kind": "lora", "target_modules": ["q_proj", "q_proj"]}, "names a projection twice"),
        ({"kind": "lora", "dropout": 0.1}, "policy.lora.dropout"),
        ({"kind": "lora", "lr": 0}, "policy.lora.lr"),
        ({"kind": "qlora"}, "unknown policy 'qlora'"),
    ):
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            build_config(overrides={"policy": fields})
    with pytest.raises(ConfigError, match="mis_ewma"):
        build_config(overrides={"policy": {"kind": "lora"}}, correction="mis_ewma")
    # The default rate is 10 × the full one; a lora base with --policy full drops the rank.
    assert build_config("demo", overrides={"policy": {"kind": "lora"}}).policy_lr == pytest.approx(1e-3)
    base = build_config(overrides={"policy": LORA}).model_dump(mode="json")
    assert build_config(base=base, overrides={"policy": {"kind": "full"}}).policy.kind == "full"


# ------------------------------------------------------------------------------- the process
def lora_learner(tmp_path, **config) -> Learner:
    return in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", policy=LORA, **config)


def version_row(learner: Learner, version: int):
    with learner.db.connect() as conn:
        return conn.execute(
            select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == version)
        ).one()


def test_the_process_publishes_adapters_rolls_back_and_resumes(tmp_path):
    learner = lora_learner(tmp_path, checkpoint_every=1, keep_versions=0)
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    learner.poll_once()
    learner.train_step()
    learner.train_step()
    for v in (1, 2):
        row = version_row(learner, v)
        folder = tmp_path / "policies" / f"v{v:06d}"
        assert layout(folder) == Layout.ADAPTER and row.parent_version == v - 1
        assert row.sha256 == weights_sha256(folder) and not (folder / "model.safetensors").exists()
    v1 = load_file(tmp_path / "policies" / "v000001" / ADAPTER_FILE)
    # Rollback to 1: its adapter, republished as version 3.
    set_flag(learner.db, ROLLBACK_TO, "1")
    assert learner.rollback(1) == 3
    v3 = load_file(tmp_path / "policies" / "v000003" / ADAPTER_FILE)
    assert v1.keys() == v3.keys() and all(torch.equal(v1[k], v3[k]) for k in v1)
    # Rollback to 0, the base model's folder: the initial adapter (B = 0), published as version 4.
    assert learner.rollback(0) == 4
    v4 = load_file(tmp_path / "policies" / "v000004" / ADAPTER_FILE)
    assert all(not v.any() for k, v in v4.items() if "lora_B" in k)
    # Version 0's whole learner state was kept at the first start (issue 40: a rollback restores
    # the whole learner): the rollback to 0 took the step count back to 0. Version 1 was never
    # promoted, so the rollback to it had its adapter only (the step count stayed 2).
    assert learner.algorithm.steps == 0
    # A restart from the checkpoint at stop (version 4) takes the head's adapter and version 0's
    # state.
    learner.checkpoint_on_stop()
    state = torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)
    assert state["version"] == 4 and all("lora_" in k for k in state["learner"]["policy"])
    again = Learner(learner.settings, learner.config)
    again.load()
    assert again.version == 4 and again.algorithm.steps == 0
    assert all(torch.equal(again.algorithm.adapter.state()[k], v4[k]) for k in v4)


def test_a_full_learner_refuses_an_adapter_folder_and_a_lora_one_a_full_checkpoint(tmp_path):
    learner = lora_learner(tmp_path, checkpoint_every=1)
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    learner.poll_once()
    learner.train_step()
    full = Learner(learner.settings, learner.config.model_copy(update={"policy": build_config().policy}))
    with pytest.raises(RuntimeError, match="another kind of policy"):
        full.load()
    (tmp_path / "policies" / CHECKPOINT_FILE).unlink()
    # Version 0's learner state kept at the first start is the LoRA learner's too.
    with pytest.raises(RuntimeError, match="another kind of policy"):
        full.load()
    shutil.rmtree(tmp_path / "policies" / "states")
    with pytest.raises(RuntimeError, match="holds a LoRA adapter"):
        full.load()


def test_a_lora_learner_refuses_states_and_adapters_of_other_settings(tmp_path):
    """α, rsLoRA or the rank changed (or b_lr_ratio 1 ↔ not) in one policy directory: the saved
    A and B would compute another update (scale α/r = 32/2 = 16 against 16/2 = 8), so the
    checkpoint, the kept state and then the adapter folder are each refused, naming the change."""
    learner = lora_learner(tmp_path, checkpoint_every=1)
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    learner.poll_once()
    learner.train_step()

    def changed(**fields) -> Learner:
        policy = learner.config.policy.model_copy(update=fields)
        return Learner(learner.settings, learner.config.model_copy(update={"policy": policy}))

    with pytest.raises(RuntimeError, match="other LoRA settings \\(alpha 32.0 → 16.0\\)"):
        changed(alpha=16.0).load()
    with pytest.raises(RuntimeError, match="rslora False → True"):
        changed(rslora=True).load()
    with pytest.raises(RuntimeError, match="b_lr_ratio 1.0 → 16.0"):
        changed(b_lr_ratio=16.0).load()
    (tmp_path / "policies" / CHECKPOINT_FILE).unlink()
    shutil.rmtree(tmp_path / "policies" / "states")
    # Left: version 1's adapter folder (adapter_config.json: r 2, lora_alpha 32).
    with pytest.raises(
        RuntimeError, match="the adapter at .*v000001 was made under other LoRA settings \\(alpha"
    ):
        changed(alpha=16.0).load()
    changed(b_lr_ratio=16.0).load()  # the weights alone hold no optimizer groups


def test_a_resumed_lora_plus_learner_trains_at_its_configs_rates(tmp_path):
    """b_lr_ratio 4 → 8 between two starts (both two groups): the checkpoint's moments are kept
    and the rates are the config's: A at 5e-4 (10 × the cpu preset's 5e-5), B at 8 × 5e-4 = 4e-3,
    not the saved 4 × 5e-4 = 2e-3."""
    lora = {"kind": "lora", "rank": RANK, "b_lr_ratio": 4.0}
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", policy=lora, checkpoint_every=1)
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    learner.poll_once()
    learner.train_step()
    assert learner.algorithm.policy_rates() == [pytest.approx(5e-4), pytest.approx(2e-3)]
    policy = learner.config.policy.model_copy(update={"b_lr_ratio": 8.0})
    again = Learner(learner.settings, learner.config.model_copy(update={"policy": policy}))
    again.load()
    assert again.version == 1 and again.algorithm.policy_opt.state
    assert again.algorithm.policy_rates() == [pytest.approx(5e-4), pytest.approx(4e-3)]


def test_saoserve_learn_policy_lora_reaches_the_learner(monkeypatch):
    import learner.process
    import saoserve.model
    from saoserve.cli import app

    runner = CliRunner()
    seen = []
    monkeypatch.setattr(learner.process, "run_learner", lambda settings, config: seen.append(config))
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    result = runner.invoke(app, ["learn", "--policy", "lora", "--lora-rank", "1", "--policy-lr", "2e-5"])
    assert result.exit_code == 0, result.output
    # rank 1, the default α 32, and 10 × 2e-5 = 2e-4 for the adapter.
    assert seen[0].policy == LoraPolicy(rank=1) and seen[0].policy_lr == pytest.approx(2e-4)
    result = runner.invoke(app, ["learn", "--policy", "lora", "--lora-rank", "0"])
    assert result.exit_code == 2 and "policy.lora.rank" in result.output


def test_the_gate_merges_a_parent_adapter_into_full_weights(tmp_path):
    from learner.guard.gate_models import GateReferences

    base_dir = tmp_path / "base"
    tiny_policy().save_pretrained(base_dir)
    lora = LoraPolicy(rank=RANK)
    adapter = Adapter(GateReferences(base_dir, str, lora)._model(), lora)
    with torch.no_grad():  # B ≠ 0, so the merge changes the weights
        for name, p in adapter.peft.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    adapter.save(tmp_path / "v1", torch.float32)
    refs = GateReferences(base_dir, lambda v: str(tmp_path / f"v{v}"), lora)
    merged = refs._weights(tmp_path / "v1")
    expected = adapter.merged_weights()
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], load_file(base_dir / "model.safetensors")[q])
    with pytest.raises(ValueError, match="holds a LoRA adapter, and this learner's policy is not LoRA"):
        GateReferences(base_dir, str, None)._weights(tmp_path / "v1")
