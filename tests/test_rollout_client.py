"""Client failover against real embedded servers: kill -9 one during a batch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter

import pytest
from _rollout import embedded_servers, tiny_hf_dir

from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.protocol import SamplingParams


@pytest.mark.server
def test_kill_9_one_of_two_servers_mid_batch_loses_and_duplicates_nothing(tmp_path):
    model = tiny_hf_dir(str(tmp_path), seed=4)
    prompts = [[10 + i % 50, 20 + i % 37, 30 + i % 11] for i in range(64)]
    new_tokens = 40

    async def run(servers):
        cfg = ClientConfig(addresses=[s.address for s in servers], retry_delay_s=0.05)
        async with RolloutClient(cfg) as client:
            done: list = []

            async def one(i, j):
                c = await client.generate(prompts[i], SamplingParams(
                    max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=i * 4 + j),
                    rid=f"p{i}-s{j}")
                done.append(c)
                return c

            tasks = [asyncio.ensure_future(one(i, j)) for i in range(64) for j in range(4)]
            while len(done) < 32:  # kill once the batch is well under way
                await asyncio.sleep(0.01)
            in_flight_on_victim = client.fleet.servers[0].in_flight
            servers[0].kill()
            out = await asyncio.gather(*tasks)
            return out, in_flight_on_victim, [s.healthy for s in client.fleet.servers]

    with embedded_servers(model, str(tmp_path / "logs"), n=2) as servers:
        out, in_flight_on_victim, healthy = asyncio.run(run(servers))
        assert servers[1].proc.poll() is None
    assert len(out) == 256
    rids = Counter(c.rid for c in out)
    assert len(rids) == 256 and set(rids.values()) == {1}
    assert {c.rid for c in out} == {f"p{i}-s{j}" for i in range(64) for j in range(4)}
    assert all(len(c.output_ids) == new_tokens == len(c.logprobs) for c in out)
    assert all(c.finish_reason["type"] == "length" for c in out)
    # Requests in flight on the victim failed over once each (a few may have had their
    # answer on the wire already); none needed more than one retry.
    moved = sum(c.attempts for c in out)
    assert 0 < moved <= in_flight_on_victim and all(c.attempts <= 1 for c in out)
    assert healthy == [False, True]


@pytest.mark.server
def test_a_request_on_a_slow_server_is_retried_elsewhere_past_its_measured_deadline(tmp_path):
    """A slow server still answers /health, so the stall watchdog keeps it; its requests
    took as long as it did (request_timeout_s: an hour). Once 16 attempts are measured,
    an attempt gets its tokens' time at a third of the median rate: on the slow server
    (0.25 s a decode step, 5 s a request) it times out and goes to the other."""
    import contextlib
    import time

    model = tiny_hf_dir(str(tmp_path), seed=4)
    new_tokens = 20

    async def run(fast, slow):
        cfg = ClientConfig(addresses=[fast.address, slow.address], retry_delay_s=0.05, slow_factor=3,
                           min_deadline_s=0.5)
        async with RolloutClient(cfg) as client:
            done: dict = {}

            async def one(rid, group, seed):
                c = await client.generate([11, 12, 13 + seed % 7], SamplingParams(
                    max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=seed), rid=rid, group=group)
                done[rid] = (c, time.monotonic())
                return c

            first = [asyncio.ensure_future(one(f"a{i}", f"g{i}", i)) for i in range(32)]
            while len(done) < 16:  # the fast server's half: the rates to measure against
                await asyncio.sleep(0.01)
            assert client.deadline(new_tokens) < 5, client.deadline(new_tokens)
            on_slow = [f"g{i}" for i in range(32) if f"a{i}" not in done]
            # Pinned to the slow server by their group (prefix affinity), which is healthy.
            second = [asyncio.ensure_future(one(f"b{g}", g, 100 + k)) for k, g in enumerate(on_slow)]
            await asyncio.gather(*first, *second)
            return done, on_slow

    with contextlib.ExitStack() as stack:
        fast = stack.enter_context(embedded_servers(model, str(tmp_path / "a"), grace_s=1))[0]
        slow = stack.enter_context(embedded_servers(model, str(tmp_path / "b"), grace_s=1,
                                                    extra_args=["--step-delay-s", "0.25"]))[0]
        done, on_slow = asyncio.run(run(fast, slow))
    assert len(on_slow) >= 8  # least-loaded placement split the first batch
    moved = [done[f"b{g}"][0] for g in on_slow]
    assert all(c.attempts == 1 and len(c.output_ids) == new_tokens for c in moved)
    # ... and they finished before the slow server's own (5 s, in flight all along).
    assert max(done[f"b{g}"][1] for g in on_slow) < max(done[f"a{g[1:]}"][1] for g in on_slow)


def _stand_in(behaviour: str, log: list):
    """A server that is slow (sleeps past the client timeout), stuck (slow, and its abort
    hangs too), broken (HTTP 503) or fine."""
    from aiohttp import web

    async def generate(request):
        body = await request.json()
        log.append((behaviour, "generate", body["rid"]))
        if behaviour in ("slow", "stuck"):
            await asyncio.sleep(3)
        if behaviour == "broken":
            return web.Response(status=503, text="overloaded")
        return web.json_response({"output_ids": [1], "meta_info": {
            "id": body["rid"], "finish_reason": {"type": "length", "length": 1},
            "weight_version": "0", "output_token_logprobs": [[-1.0, 1, None]]}})

    async def abort(request):
        log.append((behaviour, "abort", (await request.json())["rid"]))
        if behaviour == "stuck":
            await asyncio.sleep(5)  # < the client's 10 s abort timeout: close must not wait for it
        return web.Response(status=200)

    async def info(request):
        return web.json_response({"version": "0.5.23"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    app.router.add_get("/server_info", info)
    return app


async def _serve(apps) -> tuple[list, list[str]]:
    """Each aiohttp app on its own loopback port: (runners to clean up, addresses)."""
    from aiohttp import web

    from areal_mcore.net import free_port

    runners, addresses = [], []
    for app in apps:
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        addresses.append(f"127.0.0.1:{port}")
    return runners, addresses


def test_timeouts_and_5xx_fail_over_and_the_slow_server_is_told_to_abort():


    async def run():
        log: list = []
        runners, addresses = await _serve([_stand_in(b, log) for b in ("slow", "broken", "fine")])
        try:
            cfg = ClientConfig(addresses=addresses, request_timeout_s=0.5, retry_delay_s=0.01)
            async with RolloutClient(cfg) as client:
                c = await client.generate([1, 2], SamplingParams(max_new_tokens=1), rid="r1")
                await asyncio.sleep(0.2)  # the abort to the slow server is fire-and-forget
        finally:
            for r in runners:
                await r.cleanup()
        return c, log

    c, log = asyncio.run(run())
    assert c.output_ids == [1] and c.attempts == 2 and c.rid == "r1"
    assert [b for b, what, _ in log if what == "generate"] == ["slow", "broken", "fine"]
    assert [b for b, what, _ in log if what == "abort"] == ["slow"]
    # A fresh wire rid per attempt: a retry can never be refused as a "Duplicate request
    # ID" of its own earlier attempt, and the abort names the attempt it cancels.
    assert [rid for _, what, rid in log if what == "generate"] == ["r1.0", "r1.1", "r1.2"]
    assert [rid for _, what, rid in log if what == "abort"] == ["r1.0"]


def test_close_cancels_a_background_abort_still_in_flight():
    async def run():
        log: list = []
        runners, addresses = await _serve([_stand_in(b, log) for b in ("stuck", "fine")])
        try:
            cfg = ClientConfig(addresses=addresses, request_timeout_s=0.3, retry_delay_s=0.01)
            client = RolloutClient(cfg)
            await client.start()
            await client.generate([1, 2], SamplingParams(max_new_tokens=1), rid="r1")
            while not any(what == "abort" for _, what, _ in log):  # the abort reached the server
                await asyncio.sleep(0.01)
            (task,) = client._background
            t0 = asyncio.get_running_loop().time()
            await client.close()  # does not wait out the abort's 10 s timeout
            took = asyncio.get_running_loop().time() - t0
        finally:
            for r in runners:
                await r.cleanup()
        return task, took, client._background

    task, took, left = asyncio.run(run())
    assert task.cancelled() and not left and took < 2.0


def test_servers_sglang_cannot_update_over_distributed_are_refused_by_name():
    import pytest
    from aiohttp import web

    from areal_mcore.rollout.protocol import RolloutError

    def app(dp, pp):
        async def info(request):
            return web.json_response({"version": "0.5.23", "tp_size": 2, "dp_size": dp, "pp_size": pp})
        a = web.Application()
        a.router.add_get("/server_info", info)
        return a

    async def run():
        runners, addresses = await _serve([app(dp, pp) for dp, pp in ((1, 1), (2, 1), (1, 2))])
        try:
            async with RolloutClient(ClientConfig(addresses=addresses)) as client:
                with pytest.raises(RolloutError) as e:
                    client.engine.updater(client.fleet).check_distributed(pp_size=1)
                return addresses, e.value
        finally:
            for r in runners:
                await r.cleanup()

    addresses, err = asyncio.run(run())
    assert err.failed == addresses[1:]
    assert f"{addresses[1]} (dp_size=2, pp_size=1)" in str(err)
    assert f"{addresses[2]} (dp_size=1, pp_size=2)" in str(err) and "weight_sync.mode=disk" in str(err)


def test_the_master_address_is_the_one_on_the_route_to_the_servers():
    from areal_mcore.weight_sync.group import routable_address

    # Loopback servers are reached from loopback (never gethostbyname's 127.0.1.1).
    assert routable_address(["127.0.0.1:30000"]) == "127.0.0.1"
    assert routable_address(["localhost:30000"]) == "127.0.0.1"



def test_a_groups_samples_go_to_one_server_and_leave_it_only_when_it_fails():
    """Prefix caching pays only if a group's samples meet on the server holding its prompt."""
    async def run():
        logs = [[], [], []]
        apps = [_stand_in(b, log) for b, log in zip(("fine", "fine", "broken"), logs)]
        runners, addresses = await _serve(apps)
        try:
            async with RolloutClient(ClientConfig(addresses=addresses[:2])) as client:
                sampling = SamplingParams(max_new_tokens=1)
                await asyncio.gather(*[client.generate([g, 2], sampling, rid=f"{g}.{j}", group=str(g))
                                       for g in range(4) for j in range(8)])
            # A group pinned to a server that fails moves to a healthy one.
            async with RolloutClient(ClientConfig(addresses=addresses[1:], retry_delay_s=0.01)) as client:
                client._affinity["9"] = addresses[2]
                outs = await asyncio.gather(*[client.generate([9], SamplingParams(max_new_tokens=1),
                                                              rid=f"9.{j}", group="9") for j in range(4)])
        finally:
            for r in runners:
                await r.cleanup()
        return logs, outs

    logs, outs = asyncio.run(run())
    served = [{rid.split(".")[0] for _, what, rid in log if what == "generate" and rid[0] != "9"}
              for log in logs[:2]]
    assert served[0] and served[1] and not served[0] & served[1]  # both used, no group split
    assert sorted(served[0] | served[1]) == ["0", "1", "2", "3"]
    assert all(len(o.output_ids) == 1 for o in outs)
    assert {rid.split(".")[0] for _, what, rid in logs[1] if what == "generate"} >= {"9"}


def test_relax_gc_leaves_no_frozen_cycles_to_leak_at_exit():
    # gc.freeze() without gc.unfreeze() at exit: the shutdown collections skip frozen
    # objects, and nanobind reported triton's extension (its module <-> type cycles) as
    # ~30 lines of "nanobind: leaked ..." after every `areal-mcore train` (relax_gc).
    pytest.importorskip("triton")
    code = ("import gc; from triton._C import libtriton; "
            "from areal_mcore.rollout.client import relax_gc; "
            "relax_gc(); relax_gc(); assert gc.get_freeze_count() > 0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "nanobind: leaked" not in r.stderr, r.stderr


def test_a_launched_servers_port_held_by_another_process_probes_as_gone():
    """A launched server that died and whose port another process took answers /health
    through that process: the probe (before every weight push and on the stall and
    failover paths) finds it gone by who holds the port, not by what answers there."""
    import socket
    import subprocess
    import sys

    from areal_mcore.rollout.fleet import GONE, Fleet

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            fleet = Fleet([f"127.0.0.1:{port}"])
            fleet.servers[0].owner_pid = ours.pid

            async def probe():
                return await fleet.probe(fleet.servers[0], timeout=1)  # no session: no HTTP is sent
            assert asyncio.run(probe()) == GONE and not fleet.servers[0].healthy
        finally:
            ours.kill()
