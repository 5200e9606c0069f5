"""A fault-injecting HTTP proxy in front of a rollout server, for the bad-answer tests.

``FaultProxy`` runs in the test's event loop on a free loopback port and passes every
request through to its target; every ``every``-th answer to a generate call (SGLang's and
the embedded server's ``/generate``, vLLM's ``/inference/v1/generate``) that the target
answered 200 is corrupted in the next way of ``modes``, round robin (``CORRUPTIONS``).
``corrupt`` is the corruption itself, for the unit tests of the client's checks.
"""

from __future__ import annotations

import asyncio
import copy
import json

GENERATE_PATHS = ("/generate", "/inference/v1/generate")

# What a lying server may answer, each with a 200:
CORRUPTIONS = (
    "malformed_json",  # a truncated JSON body
    "empty",  # no body at all
    "no_meta",  # SGLang's meta_info (vLLM's choices) missing
    "count",  # one logprob fewer than tokens
    "nan",  # a NaN logprob
    "past_padded",  # a token id at or past the trainer's padded vocabulary: IndexError there
    "negative",  # token id -1: the tokenizer's crash
    "gap",  # an id in [vocab, padded vocab): trains silently on a row no tokenizer has
)


def corrupt(answer: dict, mode: str, backend: str, *, vocab: int, padded_vocab: int) -> bytes:
    """The body of ``answer`` (one engine's generate answer, with at least one token)
    corrupted by ``mode``; token ids are changed consistently wherever the answer repeats
    them (SGLang's logprob triples, vLLM's logprob entries), so only the one fault shows."""
    if mode == "malformed_json":
        return json.dumps(answer).encode()[:-7]
    if mode == "empty":
        return b""
    out = copy.deepcopy(answer)
    sglang = backend != "vllm"
    if mode == "no_meta":
        out.pop("meta_info" if sglang else "choices")
        return json.dumps(out).encode()
    if sglang:
        ids, entries = out["output_ids"], out["meta_info"]["output_token_logprobs"]
    else:
        choice = out["choices"][0]
        ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    if mode == "count":
        entries.pop()
    elif mode == "nan":
        _set(entries[0], sglang, logprob=float("nan"))
    else:
        token = {"past_padded": padded_vocab, "negative": -1, "gap": vocab}[mode]
        assert mode != "gap" or vocab < padded_vocab, "no gap: the vocabulary is padded to itself"
        ids[0] = token
        _set(entries[0], sglang, token_id=token)
    return json.dumps(out).encode()  # allow_nan: NaN as the literal Python's json reads back


def _set(entry, sglang: bool, *, logprob=None, token_id=None) -> None:
    if sglang:  # [logprob, token_id, text]
        if logprob is not None:
            entry[0] = logprob
        if token_id is not None:
            entry[1] = token_id
    else:  # {"token_id", "logprob"}
        if logprob is not None:
            entry["logprob"] = logprob
        if token_id is not None:
            entry["token_id"] = token_id


class FaultProxy:
    """``async with FaultProxy(target, ...) as proxy:`` serves at ``proxy.address``;
    ``applied`` lists (generate answer number, mode) of each corruption sent."""

    def __init__(self, target: str, *, backend: str = "sglang", every: int = 1,
                 modes: tuple[str, ...] = CORRUPTIONS, vocab: int, padded_vocab: int):
        self.target, self.backend, self.every, self.modes = target, backend, every, tuple(modes)
        self.vocab, self.padded_vocab = vocab, padded_vocab
        self.answers = 0  # generate answers passed back, corrupted or not
        self.applied: list[tuple[int, str]] = []
        self.address = ""
        self._runner = self._session = None

    async def __aenter__(self) -> FaultProxy:
        import aiohttp
        from aiohttp import web

        from areal_mcore.net import free_port

        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _forward(self, request):
        from aiohttp import web

        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")}
        async with self._session.request(request.method, f"http://{self.target}{request.path_qs}",
                                         data=await request.read(), headers=headers) as r:
            body, status, content_type = await r.read(), r.status, r.content_type
        if request.path in GENERATE_PATHS and status == 200:
            self.answers += 1
            if self.answers % self.every == 0:
                mode = self.modes[(self.answers // self.every - 1) % len(self.modes)]
                self.applied.append((self.answers, mode))
                body = corrupt(json.loads(body), mode, self.backend, vocab=self.vocab,
                               padded_vocab=self.padded_vocab)
        return web.Response(status=status, body=body, content_type=content_type)


async def drill(target: str, direct: str, *, backend: str, vocab: int, padded_vocab: int,
                n: int = 24, new_tokens: int = 4) -> dict:
    """The bad-answer drill against a real server: ``target`` behind a proxy that
    corrupts every generate answer, round robin through ``CORRUPTIONS``, beside
    ``direct`` (another server, or the same one reached without the proxy).

    1. ``n`` concurrent requests with faults tolerated (``max_bad_answers`` high): every
       corruption is met, and each request fails over to ``direct``;
    2. the default ``max_bad_answers``, 8 requests one after the other: the proxied
       server turns faulty after 3, is out of generation and reported gone, and the
       other 5 go direct;
    3. the proxy alone: ``RolloutError`` naming it.
    What each phase saw comes back for the test to check (``check_drill``)."""
    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.protocol import RolloutError, SamplingParams

    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    seen: dict = {"new_tokens": new_tokens, "vocab": vocab}
    async with FaultProxy(target, backend=backend, vocab=vocab, padded_vocab=padded_vocab) as proxy:
        seen["proxy"] = proxy.address

        def client(addresses, **kw):
            return RolloutClient(ClientConfig(addresses=addresses, backend=backend, vocab_size=vocab,
                                              retry_delay_s=0.01, **kw))
        async with client([proxy.address, direct], max_bad_answers=10 * n) as c:
            seen["tolerant"] = await asyncio.gather(*[c.generate([3 + i, 14, 15], sampling, rid=f"t{i}")
                                                      for i in range(n)])
        seen["modes"] = {mode for _, mode in proxy.applied}
        async with client([proxy.address, direct]) as c:  # one at a time: each meets the liar first
            seen["strict"] = [await c.generate([3 + i, 14, 15], sampling, rid=f"s{i}") for i in range(8)]
            liar = c.fleet.servers[0]
            seen["liar"] = (liar.faulty, liar.healthy, liar.answers, await c.fleet.gone_servers())
        async with client([proxy.address]) as c:
            try:
                await c.generate([3, 14, 15], sampling, rid="alone")
            except RolloutError as e:
                seen["alone"] = e
    return seen


def check_drill(seen: dict, records) -> None:
    """The drill's outcome (``records``: the client's log records)."""
    import math

    from areal_mcore.rollout.protocol import RolloutError

    proxy, n = seen["proxy"], len(seen["tolerant"])
    assert seen["modes"] == set(CORRUPTIONS), seen["modes"]
    for c in seen["tolerant"] + seen["strict"]:  # every completion valid, whatever it met
        assert len(c.output_ids) == len(c.logprobs) == seen["new_tokens"], c
        assert all(0 <= t < seen["vocab"] for t in c.output_ids), c.output_ids
        assert all(math.isfinite(x) for x in c.logprobs), c.logprobs
        assert c.attempts <= 1, c  # failed over once, from the proxy to the direct server
    assert sorted(c.rid for c in seen["tolerant"]) == sorted(f"t{i}" for i in range(n))
    faulty, healthy, answers, gone = seen["liar"]
    assert faulty and not healthy and answers == 3 and gone == [proxy], seen["liar"]
    assert sum(c.attempts for c in seen["strict"]) == 3  # out of rotation after its third
    failed = [r.getMessage() for r in records if " failed on " in r.getMessage()]
    assert failed and all(f" failed on {proxy} " in m for m in failed), failed
    assert any(f"rollout server {proxy} is faulty" in r.getMessage() for r in records)
    err = seen["alone"]
    assert type(err) is RolloutError and proxy in str(err) and "faulty for bad answers" in str(err), err
