"""Weight sync from real megatron actors (TP=2, PP=2; gloo ranks) to two embedded
servers: bitwise weights, matching logprobs, versions, bucket plans, and a server killed
mid-update."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import pytest
import torch
from _actor_setup import VOCAB
from _dist import run_gloo
from _rollout import embedded_servers, http, tiny_hf_dir
from _tiny_model import tiny_qwen2

from areal_mcore.model.args import ModelArgs
from areal_mcore.weight_sync.buckets import assign_buckets, make_plan
from areal_mcore.weight_sync.config import WeightSyncConfig
from areal_mcore.weight_sync.syncer import WeightSyncError

pytestmark = pytest.mark.server

PROMPT = [3, 14, 15, 92, 65]


def _sync_worker(rank, world, tp, pp, addresses, version, bucket_mb, flatten, disk_dir=None):
    from _actor_setup import push_once, tiny_actor

    from areal_mcore.packing import pack
    from areal_mcore.weight_sync import weight_syncer

    actor = tiny_actor(tp=tp, pp=pp)  # weights of tiny_qwen2(seed 0); the servers hold seed 21
    cfg = WeightSyncConfig(bucket_mb=bucket_mb, dtype="float32", flatten=flatten,
                           master_address="127.0.0.1", timeout_s=60,
                           mode="disk" if disk_dir else "distributed", disk_dir=disk_dir)
    syncer = weight_syncer(cfg, actor, addresses)
    stats = push_once(syncer, version)
    head = actor.groups.tp_rank == 0 and actor.groups.dp_rank == 0  # of its stage
    plan = syncer.plan() if head and not disk_dir else None
    hf = actor.hf_state_dict()  # collective over TP; the stage head keeps it
    hf = {k: v.clone() for k, v in hf.items()} if head else {}
    # Greedy continuation from server 0, then the actor's logprobs of the same tokens.
    box = [None]
    if rank == 0:
        box[0] = http(addresses[0], "POST", "/generate", {
            "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})[1]
    torch.distributed.broadcast_object_list(box, src=0)
    out = box[0]
    seq = torch.tensor(PROMPT + out["output_ids"])
    logp = actor.compute_logprobs(pack([seq]))[len(PROMPT):]
    server_logp = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    return {"hf": hf, "logp": logp, "server_logp": server_logp, "stats": stats,
            "buckets": [len(b) for b in plan.buckets] if plan else None}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("wsync")
    with embedded_servers(tiny_hf_dir(str(root), seed=21), str(root / "logs"), n=2) as s:
        yield s


def _check_servers_equal(servers, hf, version):
    assert len(hf) > 0
    for s in servers:
        for name, want in hf.items():
            status, rows = http(s.address, "POST", "/get_weights_by_name",
                                {"name": name, "truncate_size": want.shape[0]})
            assert status == 200 and torch.equal(torch.tensor(rows, dtype=torch.float32), want), name
        assert http(s.address, "GET", "/model_info")[1]["weight_version"] == str(version)


@pytest.mark.parametrize("tp, pp, flatten", [(2, 1, True), (1, 2, False)])
@pytest.mark.multirank
def test_sync_from_a_sharded_actor_makes_servers_equal_to_to_hf(servers, tp, pp, flatten):
    version = 10 * tp + pp
    # 0.02 MB buckets: smaller than the 64 KB embedding, which must travel alone.
    results = run_gloo(_sync_worker, 2, tp, pp, [s.address for s in servers], version, 0.02, flatten)
    hf = {k: v for r in results for k, v in r["hf"].items()}
    _, reference, _ = tiny_qwen2(0, vocab=VOCAB)
    assert set(hf) == set(reference)  # every stage's weights, nothing else
    _check_servers_equal(servers, hf, version)
    for r in results:  # fp32 on both sides: the servers compute what the actor computes
        torch.testing.assert_close(r["server_logp"], r["logp"], atol=1e-5, rtol=0)
    senders = [r for r in results if r["buckets"]]
    assert all(r["stats"].bytes > 0 and not r["stats"].failures for r in senders)
    assert any(1 in r["buckets"] and max(r["buckets"]) >= 1 for r in senders)


@pytest.mark.multirank
def test_disk_fallback_exports_hf_and_servers_load_it(servers, tmp_path):
    results = run_gloo(_sync_worker, 2, 1, 2, [s.address for s in servers], 33, 1024, True,
                       str(tmp_path / "export"))
    hf = {k: v for r in results for k, v in r["hf"].items()}
    _check_servers_equal(servers, hf, 33)
    for r in results:
        torch.testing.assert_close(r["server_logp"], r["logp"], atol=1e-5, rtol=0)


def test_plan_keeps_tensors_whole_and_gives_an_oversized_one_its_own_bucket():
    assert assign_buckets([5, 5, 20, 3, 3, 3], 10) == [[0, 1], [2], [3, 4, 5]]
    assert assign_buckets([11], 10) == [[0]]
    with pytest.raises(ValueError, match="budget must be > 0"):
        assign_buckets([1], 0)
    config, state, model = tiny_qwen2(0, vocab=VOCAB)
    args = ModelArgs.from_hf(config)
    from areal_mcore.model import adapter
    shard = adapter.from_hf(state, args, tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, padded_vocab=256)
    budget = 20_000  # bytes; the bf16 embedding (250 x 64 x 2 = 32 KB) exceeds it
    plan = make_plan({n: t.shape for n, t in shard.items()}, args, tp_size=2, pp_rank=0, pp_size=1,
                     dtype="bfloat16", bucket_bytes=budget)
    names = [n for i in range(len(plan.buckets)) for n in plan.bucket_meta(i)[0]]
    assert sorted(names) == sorted(state)  # each HF tensor exactly once, unpadded shapes
    shapes = {n: tuple(s) for i in range(len(plan.buckets)) for n, s in zip(*plan.bucket_meta(i))}
    assert all(shapes[n] == tuple(state[n].shape) for n in state)
    for b in plan.buckets:
        size = sum(u.nbytes(torch.bfloat16) for u in b)
        assert size <= budget or len(b) == 1
    assert [u.mcore for u in plan.buckets[0]] == ["embedding.word_embeddings.weight"]
    assert plan.nbytes == sum(t.numel() * 2 for t in state.values())


def _killing_worker(rank, world, addresses, victim):
    from _actor_setup import tiny_actor

    from areal_mcore.weight_sync import weight_syncer

    actor = tiny_actor()
    cfg = WeightSyncConfig(bucket_mb=1e-6, dtype="float32", flatten=False,  # one tensor per bucket
                           master_address="127.0.0.1", timeout_s=10)
    syncer = weight_syncer(cfg, actor, addresses)
    n_buckets = len(syncer.plan().buckets)

    async def go():
        await syncer.connect()
        try:
            stats = await syncer.push(5)
            again = await syncer.push(6)  # to the survivor alone, in the re-formed group
            return stats.dropped_servers, again.dropped_servers, again.buckets, n_buckets
        finally:
            await syncer.close()
    return asyncio.run(go())


def _survivor_after_failed_push(address: str) -> dict:
    info = http(address, "GET", "/server_info")[1]
    resumed = http(address, "POST", "/continue_generation", {}, timeout=30)[0]
    t = time.monotonic()
    status, out = http(address, "POST", "/generate", {
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                    "ignore_eos": True}}, timeout=60)
    return {"paused": info["internal_states"][0]["paused"], "version": info["weight_version"],
            "resumed": resumed, "status": status, "tokens": len(out.get("output_ids", [])),
            "generate_s": time.monotonic() - t}


def test_a_server_killed_mid_update_is_dropped_and_the_push_is_done_again_to_the_survivor(tmp_path):
    """The victim SIGKILLs itself when the 3rd bucket's call reaches it (--die-at-update):
    mid-update by construction, where a killer thread polling for the first bucket lost
    the race to the whole push under load. The push failed with WeightSyncError (a
    traceback and no checkpoint in a run); now the dead server is dropped and the push
    done again to the survivor, which then serves the new version."""
    model = tiny_hf_dir(str(tmp_path), seed=21)
    with contextlib.ExitStack() as stack:
        victim = stack.enter_context(embedded_servers(model, str(tmp_path / "victim"), n=1,
                                                      extra_args=["--die-at-update", "3"]))[0]
        survivor = stack.enter_context(embedded_servers(model, str(tmp_path / "survivor"), n=1))[0]
        addresses = [victim.address, survivor.address]
        [(dropped, dropped_again, buckets, n_buckets)] = run_gloo(_killing_worker, 1, addresses, 0)
        assert n_buckets > 3  # the kill lands mid-update, buckets before and after it
        assert victim.proc.wait(10) == -signal.SIGKILL
        assert dropped == [victim.address] and dropped_again == [] and buckets == n_buckets
        info = http(survivor.address, "GET", "/server_info")[1]
        assert info["weight_version"] == "6" and info["internal_states"][0]["paused"] is False
        status, out = http(survivor.address, "POST", "/generate", {
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                        "ignore_eos": True}}, timeout=60)
        assert status == 200 and len(out["output_ids"]) == 4


def _unsent_bucket_worker(rank, world, addresses):
    """A push whose second broadcast fails on the trainer before anything is sent (as when
    a dead peer is found first): the server was told to receive that bucket."""
    from _actor_setup import tiny_actor

    from areal_mcore.weight_sync import weight_syncer

    cfg = WeightSyncConfig(bucket_mb=1e-6, dtype="float32", flatten=False,
                           master_address="127.0.0.1", timeout_s=60)
    syncer = weight_syncer(cfg, tiny_actor(), addresses)
    sent = syncer._broadcast

    def broadcast(payload):
        if broadcast.calls == 1:
            raise RuntimeError("injected: peer found dead before this bucket was sent")
        broadcast.calls += 1
        sent(payload)
    broadcast.calls = 0
    syncer._broadcast = broadcast

    async def go():
        await syncer.connect()
        try:
            await syncer.push(5)
            return None, None
        except WeightSyncError as e:
            t = time.monotonic()
            after = _survivor_after_failed_push(addresses[0])
            return str(e), {**after, "after_error_s": time.monotonic() - t}
        finally:
            await syncer.close()
    return asyncio.run(go())


def test_a_failed_broadcast_does_not_leave_the_server_in_its_receive(tmp_path):
    """The server waits in the receive of a bucket that never comes until the trainer's
    side of the group closes (else the group's timeout: SGLang's 600 s)."""
    model = tiny_hf_dir(str(tmp_path), seed=21)
    with embedded_servers(model, str(tmp_path / "logs"), n=1) as servers:
        [(message, after)] = run_gloo(_unsent_bucket_worker, 1, [servers[0].address])
        assert message is not None and "injected" in message
        assert after["paused"] is True and after["version"] == "default"
        assert after["resumed"] == 200 and after["status"] == 200 and after["tokens"] == 4, after


# ---- SGLang's session and group rules (the embedded server enforces them) --------------

def _push_twice_worker(rank, world, addresses):
    """A push that fails mid-bucket on one server, then the next push."""
    from _actor_setup import tiny_actor

    from areal_mcore.weight_sync import weight_syncer

    actor = tiny_actor()
    cfg = WeightSyncConfig(bucket_mb=0.02, dtype="float32", flatten=True,
                           master_address="127.0.0.1", timeout_s=60)
    syncer = weight_syncer(cfg, actor, addresses)

    async def go():
        await syncer.connect()
        try:
            await syncer.push(1)
            first = None
        except WeightSyncError as e:
            first = (str(e), e.failed_servers)
        stats = await syncer.push(2)
        await syncer.close()
        return first, stats
    first, stats = asyncio.run(go())
    return first, stats, {k: v.clone() for k, v in actor.hf_state_dict().items()}


def _log_lines(server, what: str) -> list[str]:
    with open(server.log_path) as f:
        return [line.split(what, 1)[1].split()[0] for line in f if what in line]


def test_a_push_failed_mid_bucket_closes_the_session_and_the_next_push_succeeds(tmp_path):
    model = tiny_hf_dir(str(tmp_path), seed=21)
    with contextlib.ExitStack() as stack:
        good = stack.enter_context(embedded_servers(model, str(tmp_path / "a"), n=1))[0]
        # The second bucket is received, then refused, as a failed load is in SGLang.
        bad = stack.enter_context(embedded_servers(model, str(tmp_path / "b"), n=1,
                                                   extra_args=["--fail-update", "2"]))[0]
        [(first, stats, hf)] = run_gloo(_push_twice_worker, 1, [good.address, bad.address])
        assert first is not None and bad.address in first[1] and "injected fault" in first[0]
        assert not stats.failures and stats.buckets > 1
        _check_servers_equal([good, bad], hf, 2)
        for s in (good, bad):
            with open(s.log_path) as f:
                events = [("open" if "session opened" in line else "close") for line in f
                          if "weight-update session" in line]
            # begin never twice without an end in between; every session closed
            assert events == ["open", "close"] * 2, (s.address, events)
            groups = _log_lines(s, "joined weight-update group ")
            assert len(groups) == 2 and len(set(groups)) == 2  # re-formed, never reused


def _refused_bucket_worker(rank, world, addresses):
    """A push that one server refuses before its receive, then the next push."""
    from _actor_setup import tiny_actor

    from areal_mcore.weight_sync import weight_syncer

    actor = tiny_actor()
    # The group's timeout is 120 s, a bucket's broadcast may take 60 s.
    syncer = weight_syncer(WeightSyncConfig(dtype="float32", master_address="127.0.0.1",
                                           timeout_s=120), actor, addresses)

    async def go():
        await syncer.connect()
        t = time.monotonic()
        try:
            await syncer.push(1)
            first = None
        except WeightSyncError as e:
            first = (str(e), e.failed_servers)
        took = time.monotonic() - t
        stats = await syncer.push(2)
        await syncer.close()
        return first, took, stats
    first, took, stats = asyncio.run(go())
    return first, took, stats, {k: v.clone() for k, v in actor.hf_state_dict().items()}


def test_a_refused_bucket_fails_the_push_at_once_and_the_next_push_succeeds(tmp_path):
    """A server that refuses a bucket never receives it, so the broadcast cannot complete:
    the trainer waited in it for the group's timeout (120 s here; on NCCL the host never
    waits for a queued broadcast at all). Its refusal must end the push at once."""
    model = tiny_hf_dir(str(tmp_path), seed=21)
    with contextlib.ExitStack() as stack:
        good = stack.enter_context(embedded_servers(model, str(tmp_path / "a"), n=1))[0]
        bad = stack.enter_context(embedded_servers(model, str(tmp_path / "b"), n=1,
                                                   extra_args=["--refuse-update", "1"]))[0]
        [(first, took, stats, hf)] = run_gloo(_refused_bucket_worker, 1, [good.address, bad.address])
        assert first is not None and "injected refusal" in first[0], first
        assert first[1] == [bad.address], first
        print(f"the refused push failed after {took:.1f} s")
        assert took < 30, took
        assert not stats.failures and stats.buckets >= 1
        _check_servers_equal([good, bad], hf, 2)


def _stale_session_worker(rank, world, addresses):
    """A trainer that dies between begin_weight_update and end_weight_update."""
    from areal_mcore.rollout.client import ClientConfig, RolloutClient

    async def go():
        async with RolloutClient(ClientConfig(addresses=addresses)) as client:
            await client.engine.updater(client.fleet).begin("abort")  # pause, then the session
    asyncio.run(go())


def test_a_trainer_restarted_against_surviving_servers_syncs(servers):
    addresses = [s.address for s in servers]
    run_gloo(_stale_session_worker, 1, addresses)
    status, out = http(addresses[0], "POST", "/begin_weight_update", {})
    assert status == 400 and "already open" in out["message"]  # what the new trainer meets
    results = run_gloo(_sync_worker, 1, 1, 1, addresses, 7, 1024, True)
    _check_servers_equal(servers, results[0]["hf"], 7)


@pytest.mark.multirank
def test_stage_groups_form_one_stage_at_a_time_whatever_the_arrival_order(tmp_path):
    """Each server serves init calls one at a time, each blocking until its group forms
    (as SGLang does). Server A gets stage 1's call first and server B stage 0's: had the
    stages initialised concurrently, A and B would wait on each other for ever."""
    model = tiny_hf_dir(str(tmp_path), seed=21)
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(embedded_servers(model, str(tmp_path / "a"), n=1, extra_args=[
            "--delay-group-init", "_pp0_=1.5"]))[0]
        b = stack.enter_context(embedded_servers(model, str(tmp_path / "b"), n=1, extra_args=[
            "--delay-group-init", "_pp1_=1.5"]))[0]
        results = run_gloo(_sync_worker, 2, 1, 2, [a.address, b.address], 12, 1024, True)
        hf = {k: v for r in results for k, v in r["hf"].items()}
        _check_servers_equal([a, b], hf, 12)
        assert [g.split("_pp")[1][0] for g in _log_lines(a, "joined weight-update group ")] \
            == ["0", "1"]  # stage 0 first despite the delay


def test_full_sync_against_the_old_api_server(tmp_path):
    """SGLang 0.5.20's routes (no update sessions, /get_weight_version a 404): the sync
    runs without begin/end and the version is read from /model_info."""
    model = tiny_hf_dir(str(tmp_path), seed=21)
    with embedded_servers(model, str(tmp_path / "logs"), n=1,
                          extra_args=["--sglang-api", "0.5.20"]) as old:
        results = run_gloo(_sync_worker, 1, 1, 1, [old[0].address], 9, 0.02, True)
        _check_servers_equal(old, results[0]["hf"], 9)
        assert not results[0]["stats"].failures


def _sync_while_generating_worker(rank, world, addresses):
    """For each pause mode: 16 requests generating, a push in the middle of them."""
    from _actor_setup import tiny_actor

    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.protocol import SamplingParams
    from areal_mcore.weight_sync import weight_syncer

    actor = tiny_actor()
    out = {}

    async def go():
        client = RolloutClient(ClientConfig(addresses=addresses))
        await client.start()
        for version, mode in enumerate(("abort", "retract", "in_place"), start=1):
            cfg = WeightSyncConfig(dtype="float32", master_address="127.0.0.1", timeout_s=60,
                                   pause_mode=mode)
            syncer = weight_syncer(cfg, actor, client.fleet)  # shared, as on the trainer's rank 0
            await syncer.connect()
            sampling = SamplingParams(max_new_tokens=48, ignore_eos=True)
            steps = _decode_steps(addresses[0])
            jobs = [asyncio.ensure_future(client.generate(PROMPT, sampling)) for _ in range(16)]
            while _decode_steps(addresses[0]) < steps + 5:  # mid-generation
                await asyncio.sleep(0.01)
            await syncer.push(version)
            out[mode] = [(c.versions, len(c.output_ids), c.finish_reason["type"])
                         for c in await asyncio.gather(*jobs)]
            await syncer.close()
        await client.close()
    asyncio.run(go())
    return out


def _decode_steps(address: str) -> int:
    return http(address, "GET", "/server_info")[1]["internal_states"][0]["decode_steps"]


def test_a_sync_while_requests_generate_tags_every_token_with_its_version_in_each_pause_mode(tmp_path):
    model = tiny_hf_dir(str(tmp_path), seed=21)
    # 50 ms a decode step: the 43 steps left after the push starts outlast the push even on
    # busy cores (without it a push slowed by load once arrived after every request had
    # finished, and no completion spanned the update)
    with embedded_servers(model, str(tmp_path / "logs"), n=1, extra_args=["--step-delay-s", "0.05"]) as s:
        [out] = run_gloo(_sync_while_generating_worker, 1, [s[0].address])
    before = {"abort": "default", "retract": "1", "in_place": "2"}  # what each push replaces
    for version, mode in enumerate(("abort", "retract", "in_place"), start=1):
        rows = out[mode]
        assert len(rows) == 16, mode  # none lost
        for versions, n, finish in rows:
            assert n == 48 and finish == "length" and len(versions) == n, mode
            # old weights, then new ones; never back
            assert versions == sorted(versions, key=lambda v: v == str(version)), (mode, versions)
            assert set(versions) <= {before[mode], str(version)}, (mode, set(versions))
        assert any(len(set(v)) == 2 for v, _, _ in rows), (mode, "no completion spans the update")


def _refused_connect_worker(rank, world, addresses):
    from _actor_setup import tiny_actor

    from areal_mcore.weight_sync import weight_syncer

    syncer = weight_syncer(WeightSyncConfig(dtype="float32", master_address="127.0.0.1", timeout_s=120),
                          tiny_actor(), addresses)

    async def go():
        t = time.monotonic()
        try:
            await syncer.connect()
        except WeightSyncError as e:
            return str(e), time.monotonic() - t
        finally:
            await syncer.close()
        return None, time.monotonic() - t
    return asyncio.run(go())


def test_a_server_that_refuses_the_group_fails_the_setup_at_once_not_at_the_stores_timeout(tmp_path):
    """The trainer's side of the rendezvous waits for every rank until weight_sync.timeout_s
    (120 s here): a server's refusal, answered at once, must end the setup at once."""
    model = tiny_hf_dir(str(tmp_path), seed=21)
    with embedded_servers(model, str(tmp_path / "logs"), n=1, extra_args=["--refuse-group-init"]) as servers:
        [(message, took)] = run_gloo(_refused_connect_worker, 1, [servers[0].address])
    assert message is not None and "injected refusal" in message, message
    assert took < 60, took


def _stopped_between_pushes_worker(rank, world, addresses, victim_pid):
    """A client generating on both servers, the second SIGSTOPped after the syncer
    connected (a hung engine found by no one yet), then a push on the client's fleet."""
    import os

    from _actor_setup import tiny_actor

    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.protocol import SamplingParams
    from areal_mcore.weight_sync import weight_syncer

    actor = tiny_actor()
    cfg = WeightSyncConfig(bucket_mb=1.0, dtype="float32", master_address="127.0.0.1", timeout_s=60)
    sampling = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)

    async def go():
        # The client's watchdog would find the stall only after 60 s: the push must find it.
        async with RolloutClient(ClientConfig(addresses=addresses, stall_after_s=60, stall_probe_s=3)) as c:
            syncer = weight_syncer(cfg, actor, c.fleet)
            await syncer.connect()
            gen = asyncio.gather(*[c.generate(PROMPT, sampling, rid=f"s{i}") for i in range(8)])
            victim = c.fleet.servers[1]
            while victim.in_flight < 4:  # least-loaded placement: half of them there
                await asyncio.sleep(0.01)
            os.kill(victim_pid, signal.SIGSTOP)
            t = time.monotonic()
            stats = await syncer.push(4)
            took = time.monotonic() - t
            outs = await asyncio.wait_for(gen, 60)
            await syncer.close()
        return {"took": took, "dropped": stats.dropped_servers,
                "lengths": [len(o.output_ids) for o in outs], "moved": sum(o.attempts for o in outs)}
    try:
        return asyncio.run(go())
    finally:
        os.kill(victim_pid, signal.SIGCONT)


def test_a_server_stopped_between_pushes_is_dropped_by_the_next_push_in_one_probe(servers):
    """Runs last: it stops the module's second server. A server SIGSTOPped since the
    rollout last heard from it passed the push's /health probe (30 s, then "slow", kept),
    the push's pause waited on it (stall_after_s + stall_probe_s), failed, and was done
    again: 102 s for the step of a tiny async run that found it (30 s after this fix, at
    the default stall_probe_s). Now a probe that gets no answer within stall_probe_s finds
    it stalled before the push, and its requests in flight move to the other server at
    once (they waited for the client's watchdog, which skips unhealthy servers)."""
    [out] = run_gloo(_stopped_between_pushes_worker, 1, [s.address for s in servers], servers[1].proc.pid)
    print(out)
    assert out["dropped"] == [servers[1].address] and out["took"] < 10, out
    assert out["lengths"] == [200] * 8 and out["moved"] >= 4, out
    assert http(servers[0].address, "GET", "/model_info")[1]["weight_version"] == "4"
