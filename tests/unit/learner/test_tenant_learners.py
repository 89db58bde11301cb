"""Many tenant policies in one learner process (issue 39 item 3; learner.shared_base,
learner.tenants; docs/tenants.md, "Many tenants in one learner"): one frozen base shared by every
policy and critic, the isolation gate (tenant B bit-identical across tenant A's steps), the
round-robin order, and the process on two namespaces.

Tiny random Llamas (testing.models; testing.learner for the process); no engine.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref

import pytest
import torch
from sqlalchemy import select

from core import tenant_store
from core.control import PAUSED, ROLLBACK_TO, set_flag
from core.db import PolicyVersion, make_engine, migrate
from core.logbus import open_log
from core.policies import GLOBAL
from core.policy_store import CHECKPOINT_FILE, Layout, layout
from learner.algo.critic import ValueModel
from learner.config import LearnerConfig
from learner.data.batch import policy_logprobs
from learner.shared_base import AdapterCritic, SharedBase
from learner.tenants import (
    TenantLearners,
    TenantLoadError,
    listed_namespace,
    namespace_of,
    policy_names,
    visit_order,
)
from testing.learner import BATCH, feed, tiny_model_dir
from testing.models import FAST, make_batch, make_config, tiny_policy
from testing.servers import make_settings
from testing.tenants import tenant_settings

LORA = {"kind": "lora", "rank": 2}


def config(bf16: bool = False, **fields):
    return make_config(**FAST, kl_coef=0.1, bf16=bf16, policy=LORA, **fields)


def logprobs(algorithm, batch) -> torch.Tensor:
    mask = batch.action_mask.bool()
    with torch.no_grad():
        return policy_logprobs(
            algorithm.policy, batch.input_ids, batch.attention_mask, batch.temperatures, positions=mask
        )


def snapshot(algorithm, batch) -> dict:
    """Everything of one learner the isolation gate compares: its adapter, its critic's own
    tensors, both optimizers' states (deep copies), its logprobs and values on ``batch``."""
    with torch.no_grad():
        values = algorithm.critic(batch.input_ids, batch.attention_mask)
    return copy.deepcopy(
        {
            "adapter": algorithm.adapter.state(),
            "critic": algorithm.critic.state_dict(),
            "policy_optimizer": algorithm.policy_opt.state_dict(),
            "critic_optimizer": algorithm.critic_opt.state_dict(),
            "logprobs": logprobs(algorithm, batch),
            "values": values,
        }
    )


def identical(a, b) -> bool:
    """Bit-identical nested states (tensors by ``torch.equal``, with their dtypes)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ------------------------------------------------------------------------- one shared base
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_every_policy_and_critic_computes_on_the_same_base_tensors(bf16):
    base = SharedBase(tiny_policy())
    a, b = base.build(config(bf16)), base.build(config(bf16))
    shared = {n: p.data_ptr() for n, p in base.tensors().items()}
    dtype = torch.bfloat16 if bf16 else torch.float32
    for algorithm in (a, b):
        # PEFT's names: base_model.model.<name>, with .base_layer. before an adapted weight.
        policy = {
            n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
            for n, p in algorithm.policy.named_parameters()
            if "lora_" not in n
        }
        assert policy.keys() == shared.keys()
        assert all(p.data_ptr() == shared[n] and not p.requires_grad for n, p in policy.items())
        assert all(p.dtype == dtype for p in policy.values())
        body = {
            "model." + n.removeprefix("backbone.").replace(".base_layer.", "."): p
            for n, p in algorithm.critic.named_parameters()
            if "lora_" not in n and not n.startswith("head.")
        }
        assert body and all(p.data_ptr() == shared[n] and not p.requires_grad for n, p in body.items())
    # Each keeps its own adapter, critic adapter and head.
    own = [
        {p.data_ptr() for p in (*x.adapter.parameters(), *x.critic.trainable_parameters())} for x in (a, b)
    ]
    assert own[0] and not own[0] & own[1] and not own[0] & set(shared.values())


def test_the_critic_trains_its_mlp_adapter_and_head_and_checkpoints_only_them():
    lora = config().policy
    critic = SharedBase(tiny_policy()).adapter_critic(lora)
    names = critic.own_names()
    assert names == set(critic.state_dict())
    assert {n.split(".")[-4] for n in names if "lora_" in n} == {"gate_proj", "up_proj", "down_proj"}
    assert {n for n in names if "lora_" not in n} == {"head.weight", "head.bias"}
    # r·(in + out) per MLP projection: gate, up, down each 2·(32 + 64), 2 layers; the head 32 + 1.
    assert sum(p.numel() for p in critic.trainable_parameters()) == 2 * 3 * 2 * 96 + 33
    # At B = 0 it computes what the paper's critic does at its start (the same body and head).
    batch = make_batch(tiny_policy())
    paper = ValueModel.from_policy(tiny_policy())
    with torch.no_grad():
        ours = critic(batch.input_ids, batch.attention_mask)
        assert torch.equal(ours, paper(batch.input_ids, batch.attention_mask))
    # A critic of the paper's form (its body: e.g. a pretrained one) does not load into it.
    with pytest.raises(ValueError, match="adapter and value head only"):
        critic.load_state_dict(paper.state_dict())
    again = AdapterCritic(SharedBase(tiny_policy(1)).view().base_model, 32, lora)
    with torch.no_grad():
        critic.head.bias.fill_(0.25)
    again.load_state_dict(critic.state_dict())
    assert identical(again.state_dict(), critic.state_dict())


def test_a_shared_base_refuses_what_would_train_it():
    base = SharedBase(tiny_policy())
    with pytest.raises(ValueError, match="the config's policy is 'full'"):
        base.build(make_config())
    with pytest.raises(ValueError, match="critic_trainable 'all' would train the shared body"):
        base.build(config(critic_trainable="all"))
    assert not any(p.requires_grad for p in base.model.parameters())


# ------------------------------------------------------------------------- the isolation gate
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_isolation_gate_tenant_b_is_bit_identical_across_tenant_a_steps(bf16):
    """tinker-cloud's gate: B's adapter, critic, optimizer states and the logprobs and values it
    computes on a fixed batch are bit-identical before and after tenant A is built and steps;
    and B's next step is the one a learner alone on a base of its own takes."""
    batch = make_batch(tiny_policy())
    base = SharedBase(tiny_policy())
    b = base.build(config(bf16))
    b.step(batch)  # B has optimizer moments and a moved adapter to keep
    before = snapshot(b, batch)
    a = base.build(config(bf16))
    for seed in range(3):
        a.step(make_batch(tiny_policy(), seed=seed + 1))
    assert not identical(a.adapter.state(), b.adapter.state())
    assert identical(snapshot(b, batch), before)
    alone = SharedBase(tiny_policy()).build(config(bf16))
    alone.step(batch)
    assert identical(snapshot(alone, batch), before)
    b.step(batch)
    alone.step(batch)
    assert identical(snapshot(b, batch), snapshot(alone, batch))


# ------------------------------------------------------------------------- scheduling
@pytest.mark.parametrize(
    ("round_no", "order"),
    [
        (0, ["a", "b", "c"]),
        (1, ["b", "c", "a"]),
        (2, ["c", "a", "b"]),
        (3, ["a", "b", "c"]),
        (4, ["b", "c", "a"]),
    ],
)
def test_visit_order_rotates_one_place_a_round(round_no, order):
    assert visit_order(["a", "b", "c"], round_no) == order


def test_visit_order_of_one_or_no_policy():
    assert visit_order(["a"], 7) == ["a"]
    assert visit_order([], 3) == []


# ------------------------------------------------------------------------- the process
def tenant_learners(tmp_path, names=("acme", "beta"), **fields) -> TenantLearners:
    """The learners of ``names`` in one process on the tiny model, each namespace migrated."""
    settings = tenant_settings(
        tmp_path, model_dir=tiny_model_dir(tmp_path / "model"), policy_dir=tmp_path / "policies"
    )
    for name in {GLOBAL, *names}:  # the global database holds the API keys
        migrate(namespace_of(settings, name).resolved_database_url)
    learners = TenantLearners(
        settings, names, LearnerConfig(batch_size=BATCH, poll_s=0.01, policy=LORA, **fields)
    )
    learners.load()
    return learners


def test_a_policy_whose_state_does_not_load_is_named(tmp_path, monkeypatch):
    learners = tenant_learners(tmp_path)

    def refuse():
        raise ValueError("an adapter critic holds its adapter and value head only")

    monkeypatch.setattr(learners.learners["beta"], "load", refuse)
    with pytest.raises(TenantLoadError, match="^policy 'beta' cannot be loaded: an adapter critic holds"):
        learners.load()


def versions(learner) -> list[int]:
    with learner.db.connect() as conn:
        return sorted(conn.execute(select(PolicyVersion.version)).scalars())


def test_a_busy_tenant_takes_one_step_a_round_and_the_quiet_one_its_step_in_the_first(tmp_path):
    learners = tenant_learners(tmp_path, ("acme", "beta", GLOBAL))
    acme, beta, glob = (learners.learners[n] for n in ("acme", "beta", GLOBAL))
    feed(open_log(acme.settings.resolved_log_url), 3 * BATCH, 0)  # three batches
    feed(open_log(beta.settings.resolved_log_url), BATCH, 100)  # one
    assert learners.run_round() == 2
    assert (versions(acme), versions(beta), versions(glob)) == ([0, 1], [0, 1], [0])
    assert learners.run_round() == 1 and learners.run_round() == 1 and learners.run_round() == 0
    assert (versions(acme), versions(beta)) == ([0, 1, 2, 3], [0, 1])
    # Each published its adapters in its own folder; all three trained on one base.
    assert layout(tmp_path / "policies" / "tenants" / "acme" / "v000003") == Layout.ADAPTER
    assert layout(tmp_path / "policies" / "tenants" / "beta" / "v000001") == Layout.ADAPTER
    assert not (tmp_path / "policies" / "v000001").exists()
    embed = {id(lrn.algorithm.policy.get_input_embeddings().weight) for lrn in (acme, beta, glob)}
    assert embed == {id(learners.base.model.get_input_embeddings().weight)}


def test_a_paused_or_failing_tenant_is_passed_over_and_the_others_step(tmp_path, monkeypatch):
    learners = tenant_learners(tmp_path)
    acme, beta = learners.learners["acme"], learners.learners["beta"]
    feed(open_log(acme.settings.resolved_log_url), 2 * BATCH, 0)
    feed(open_log(beta.settings.resolved_log_url), 2 * BATCH, 100)
    set_flag(acme.db, PAUSED, "1")
    assert learners.run_round() == 1
    assert (versions(acme), versions(beta)) == ([0], [0, 1])
    set_flag(acme.db, PAUSED, None)

    def outage():
        raise OSError("database is down")

    monkeypatch.setattr(beta, "visit", outage)
    assert learners.run_round() == 1  # beta's failure is logged; acme steps
    assert learners.run_round() == 1  # acme again; beta waits out its retry time, unvisited
    assert (versions(acme), versions(beta)) == ([0, 1, 2], [0, 1])
    monkeypatch.undo()
    learners._retry_at.clear()
    assert learners.run_round() == 1 and versions(beta) == [0, 1, 2]


def test_a_rollback_request_is_carried_out_by_its_own_tenant_only(tmp_path):
    learners = tenant_learners(tmp_path)
    acme, beta = learners.learners["acme"], learners.learners["beta"]
    feed(open_log(acme.settings.resolved_log_url), BATCH, 0)
    feed(open_log(beta.settings.resolved_log_url), 2 * BATCH, 100)
    assert learners.run_round() == 2
    set_flag(acme.db, ROLLBACK_TO, "0")
    assert learners.run_round() == 2  # acme's rollback (its version 2), beta's second step
    assert (versions(acme), versions(beta)) == ([0, 1, 2], [0, 1, 2])
    assert all(not v.any() for k, v in acme.algorithm.adapter.state().items() if "lora_B" in k)
    assert any(v.any() for k, v in beta.algorithm.adapter.state().items() if "lora_B" in k)


def test_run_stops_when_every_tenant_did_max_steps_and_checkpoints_each(tmp_path):
    learners = tenant_learners(tmp_path, max_steps=1)
    for name, start in (("acme", 0), ("beta", 100)):
        feed(open_log(learners.learners[name].settings.resolved_log_url), 2 * BATCH, start)
    learners.run(threading.Event())
    for name in ("acme", "beta"):
        learner = learners.learners[name]
        assert versions(learner) == [0, 1] and learner.algorithm.steps == 1
        state = torch.load(tmp_path / "policies" / "tenants" / name / CHECKPOINT_FILE, weights_only=False)
        assert (
            state["version"] == 1 and set(state["learner"]["critic"]) == learner.algorithm.critic.own_names()
        )


# ------------------------------------------------------------------------- the names
def test_policy_names_of_the_command_line(tmp_path):
    settings = tenant_settings(tmp_path)
    assert policy_names(settings, "beta, global", False) == ["beta", GLOBAL]
    assert policy_names(settings, None, True) is None  # the database's list, followed
    refusals = [
        ((None, False), "give --tenants A,B or --all-tenants"),
        (("acme", True), "give --tenants A,B or --all-tenants"),
        ((" , ", False), "--tenants names no policy"),
        (("acme,beta,acme", False), "--tenants names acme more than once"),
        (
            ("acme,zeta", False),
            "tenant 'zeta' has no policy of its own (SAOSERVE_TENANT_POLICIES: acme, beta)",
        ),
    ]
    for (given, every), message in refusals:
        with pytest.raises(ValueError) as caught:
            policy_names(settings, given, every)
        assert str(caught.value) == message
    assert policy_names(make_settings(tmp_path), None, True) is None


# ------------------------------------------------------------------------- following the list
def following(tmp_path, names=("acme",)) -> tuple[TenantLearners, object]:
    """``--all-tenants``' learners: the global database's list seeded with ``names``, followed;
    and the global database's engine (to change the list)."""
    learners = tenant_learners(tmp_path, names)
    db = make_engine(learners.settings.resolved_database_url)
    tenant_store.seed(db, names)
    learners.follow(lambda: tenant_store.read(db))
    return learners, db


def test_a_tenant_added_to_the_list_gets_a_learner_on_the_shared_base_at_the_next_round(tmp_path):
    learners, db = following(tmp_path)
    zeta = listed_namespace(learners.settings, "zeta")
    assert tenant_store.add(db, "zeta") is True
    migrate(zeta.resolved_database_url)
    feed(open_log(zeta.resolved_log_url), BATCH, 200)
    assert learners.run_round() == 1  # zeta built, loaded at version 0 and stepped
    assert list(learners.learners) == ["acme", "zeta"]
    new = learners.learners["zeta"]
    assert (
        versions(new) == [0, 1]
        and new.settings.resolved_policy_dir == tmp_path / "policies" / "tenants" / "zeta"
    )
    assert layout(tmp_path / "policies" / "tenants" / "zeta" / "v000001") == Layout.ADAPTER
    embed = new.algorithm.policy.get_input_embeddings().weight
    assert embed is learners.base.model.get_input_embeddings().weight


def test_a_tenant_removed_from_the_list_is_checkpointed_and_its_learner_freed(tmp_path):
    learners, db = following(tmp_path, ("acme", "beta"))
    acme = learners.learners["acme"]
    feed(open_log(acme.settings.resolved_log_url), BATCH, 0)
    assert learners.run_round() == 1 and versions(acme) == [0, 1]
    freed = weakref.ref(acme.algorithm)
    assert tenant_store.remove(db, "acme") is True
    del acme
    assert learners.run_round() == 0
    gc.collect()
    assert list(learners.learners) == ["beta"] and freed() is None
    state = torch.load(tmp_path / "policies" / "tenants" / "acme" / CHECKPOINT_FILE, weights_only=False)
    assert state["version"] == 1
    # Added back, it resumes from that checkpoint, on the same base.
    tenant_store.add(db, "acme")
    learners.run_round()
    back = learners.learners["acme"]
    assert back.version == 1 and back.algorithm.steps == 1


def test_a_tenant_that_cannot_be_built_is_retried_and_the_others_go_on(tmp_path, monkeypatch):
    learners, db = following(tmp_path)
    acme = learners.learners["acme"]
    feed(open_log(acme.settings.resolved_log_url), 2 * BATCH, 0)
    tenant_store.add(db, "zeta")
    real = TenantLearners.add

    def broken(self, name):
        raise OSError("disk full")

    monkeypatch.setattr(TenantLearners, "add", broken)
    assert learners.run_round() == 1 and list(learners.learners) == ["acme"]
    monkeypatch.setattr(TenantLearners, "add", real)
    # Tried again max(poll_s, 2) = 2 s after the failure, not at once.
    assert 0 < learners._retry_at["zeta"] - time.monotonic() <= 2.0
    learners._retry_at.clear()
    learners.run_round()
    assert list(learners.learners) == ["acme", "zeta"]


def test_a_list_that_cannot_be_read_keeps_the_learners(tmp_path):
    learners, _ = following(tmp_path)

    def outage():
        raise OSError("database is down")

    learners.follow(outage)
    assert learners.run_round() == 0 and list(learners.learners) == ["acme"]


def test_an_explicit_list_stays_fixed_whatever_the_database_holds(tmp_path):
    learners = tenant_learners(tmp_path)
    db = make_engine(learners.settings.resolved_database_url)
    tenant_store.seed(db, ["zeta"])
    learners.run_round()
    assert list(learners.learners) == ["acme", "beta"]
