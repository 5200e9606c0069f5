"""Continuous-batching decoder over a transformers causal LM, for the embedded server.

Legend: B running requests, N joining requests, L cached length, V vocab.

One engine thread owns the model. Requests that arrive together are prefilled together;
between decode steps new requests join: their KV cache is left-padded to the running
batch's length and concatenated along the batch, and an attention mask hides the padding.
Finished requests leave by index-select, and cache columns that became padding in every
row are trimmed. Control work (weight loads, flush checks) runs on the same thread
between steps, so it never interleaves with a forward pass.

MoE routing (``return_routed_experts``): forward hooks on the routers keep the experts each
forwarded token went to, per layer; a request that asked for them gets its prefill's rows
(redone with the context on a re-prefill) and one row per decode step, so at the end they
cover every token but the last sampled one, as SGLang's and vLLM's capturers do.

Pausing follows SGLang's three modes (``PauseGenerationReqInput``): ``abort`` answers every
request as aborted and holds new ones; ``retract`` sends running requests back to the
waiting queue without their KV cache (recomputed from prompt + output on resume);
``in_place`` keeps them and their cache and just stops stepping. Each request records the
weight version changes it lives through, reported as SGLang's ``weight_versions`` spans.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from areal_mcore.rollout.protocol import (
    PAUSE_MODES,
    SamplingParams,
    finish_abort,
    finish_length,
    finish_stop,
)


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Request], None]  # called on the engine thread
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_version: str = ""
    abort_message: str | None = None
    # (old version, output tokens so far) at each weight change, as SGLang records them
    version_events: list[tuple[str, int]] = field(default_factory=list)
    return_routed_experts: bool = False
    routed: list[torch.Tensor] = field(default_factory=list)  # [n, layers, K] int32 per forward

    def routed_experts(self) -> torch.Tensor | None:
        """[forwarded tokens, layers, K] int32: the experts of every token the engine
        forwarded (all but the last sampled one); None if it forwarded none or none were kept."""
        return torch.cat(self.routed) if self.routed else None

    @property
    def context_ids(self) -> list[int]:
        """What a (re-)prefill runs over: a retracted request resumes where it stopped."""
        return self.input_ids + self.output_ids

    def weight_versions(self) -> list[dict]:
        """SGLang's ``meta_info.weight_versions``: contiguous spans of output tokens, each
        with the version that produced it (``utils/weight_versions.py``)."""
        spans: list[dict] = []
        n = len(self.output_ids)
        for version, end in [*self.version_events, (self.weight_version, n)]:
            end = min(end, n)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = end
            else:
                spans.append({"version": version, "start": spans[-1]["end"] if spans else 0,
                              "end": end})
        return spans


class DecodeEngine:
    """Batched sampling with a KV cache; thread-safe ``submit``/``abort``/``pause``/``call``."""

    def __init__(self, model, *, eos_token_ids: list[int], context_length: int,
                 max_running_requests: int = 64, seed: int = 0, weight_version: str = "default",
                 step_delay_s: float = 0.0, return_routed_experts: bool = False):
        """``step_delay_s``: fault injection (a slow engine), a sleep after each decode step.
        ``return_routed_experts``: keep the routers' choices for requests that ask (the
        server's --enable-return-routed-experts)."""
        self.model = model
        self._router_hooks = _RouterHooks(model) if return_routed_experts else None
        self.step_delay_s = step_delay_s
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.eos_token_ids = list(eos_token_ids)
        self.context_length = context_length
        self.max_running_requests = max_running_requests
        self.seed = seed
        self.weight_version = weight_version
        self.paused = False
        self.steps = 0
        self.generated_tokens = 0
        self._seeded = 0
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        # Taken from the queue and being prefilled: an abort must reach these too, or a
        # pause(abort) racing a prefill leaves a request running (and flush_cache refused).
        self._joining: list[Request] = []
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._mask_BL: torch.Tensor | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._thread.start()

    # ---- thread-safe API -------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if len(req.input_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(req.input_ids)} tokens; context_length is "
                             f"{self.context_length}")
        with self._cond:
            if any(r.rid == req.rid for r in self._live()):
                # SGLang's tokenizer manager refuses a rid it is still serving.
                raise ValueError(f"Duplicate request ID: {req.rid!r} is already running")
            seed = req.params.sampling_seed
            if seed is None:  # per-server seed + arrival order: reproducible for one client
                seed = self.seed * 1_000_003 + self._seeded
                self._seeded += 1
            req.generator = torch.Generator().manual_seed(seed)
            if req.params.max_new_tokens == 0:  # nothing to sample: answer without a step
                self._done(req, finish_length(0))
                return
            self._waiting.append(req)
            self._cond.notify()

    def abort(self, rid: str | None = None, *, abort_all: bool = False,
              message: str = "Abort requested") -> int:
        """Marks requests aborted; they finish with their partial output. Returns the count."""
        with self._cond:
            hits = [r for r in self._live() if abort_all or r.rid == rid]
            for r in hits:
                r.abort_message = message
            self._cond.notify()
        return len(hits)

    def pause(self, mode: str) -> None:
        """Stops stepping in one of SGLang's modes (see the module docstring); returns at a
        step boundary, with aborted requests answered."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        with self._cond:
            self.paused = True
        if mode == "abort":
            self.abort(abort_all=True, message="Aborted by pause_generation")
        self.call(self._retract if mode == "retract" else (lambda: None)).result()

    def set_weight_version(self, version: str) -> None:
        """On the engine thread (inside ``call``): live requests remember the change."""
        with self._cond:
            for r in self._live():
                if r.output_ids:
                    r.version_events.append((self.weight_version, len(r.output_ids)))
            self.weight_version = version

    def resume(self) -> None:
        with self._cond:
            self.paused = False
            self._cond.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Runs ``fn`` on the engine thread between decode steps."""
        fut: Future = Future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    @property
    def num_running(self) -> int:
        with self._cond:
            return len(self._running) + len(self._waiting)

    @property
    def busy(self) -> bool:
        """Requests hold KV cache or are about to; requests held by a pause do not count
        (SGLang holds those before the scheduler, so a flush may run)."""
        with self._cond:
            return bool(self._running or self._joining) or (bool(self._waiting) and not self.paused)

    def _live(self):  # holds the lock
        return (*self._running, *self._joining, *self._waiting)

    def _retract(self) -> None:
        """Running requests go back to the front of the queue; their KV cache is dropped."""
        with self._cond:
            self._waiting.extendleft(reversed(self._running))
            self._running = []
            self._kv = self._mask_BL = None

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._calls or self._has_aborts() or
                           (not self.paused and (self._waiting or self._running))):
                    self._cond.wait()
                if self._stopped:
                    return
                calls = list(self._calls)
                self._calls.clear()
                self._finish_aborted()
                joining = self._joining = []
                while (not self.paused and self._waiting
                       and len(self._running) + len(joining) < self.max_running_requests):
                    joining.append(self._waiting.popleft())
            for fn, fut in calls:
                # Running, a call can no longer be cancelled: a caller that goes away
                # meanwhile (its HTTP handler cancelled on disconnect) must not leave a
                # cancelled future that set_result refuses, killing this thread. One
                # cancelled before it ran is skipped.
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            with torch.inference_mode():
                if joining:
                    self._prefill(joining)
                elif self._running and not self.paused:
                    self._decode_step()
                    if self.step_delay_s:
                        time.sleep(self.step_delay_s)

    def _has_aborts(self) -> bool:
        return any(r.abort_message for r in self._live())

    def _finish_aborted(self) -> None:  # holds the lock
        for r in [r for r in self._waiting if r.abort_message]:
            self._waiting.remove(r)
            self._done(r, finish_abort(r.abort_message))
        gone = [i for i, r in enumerate(self._running) if r.abort_message]
        for i in gone:
            self._done(self._running[i], finish_abort(self._running[i].abort_message))
        self._drop(gone)

    def _prefill(self, joining: list[Request]) -> None:
        n, length = len(joining), max(len(r.context_ids) for r in joining)
        ids_NL = torch.zeros(n, length, dtype=torch.long)
        mask_NL = torch.zeros(n, length, dtype=torch.long)
        for i, r in enumerate(joining):  # left padding keeps every row's last token at -1
            ctx = r.context_ids
            ids_NL[i, length - len(ctx):] = torch.tensor(ctx)
            mask_NL[i, length - len(ctx):] = 1
        logits_NV, kv = self._forward(ids_NL, mask_NL, None)
        if self._router_hooks is not None:  # a re-prefill (retract) redoes the context's rows
            for i, r in enumerate(joining):
                r.routed = [self._routed_BLnK[i, length - len(r.context_ids):]] if r.return_routed_experts else []
        if self._kv is None:
            self._kv, self._mask_BL = kv, mask_NL
        else:
            width = max(self._mask_BL.shape[1], length)
            old = [tuple(_left_pad(t, width, dim=2) for t in pair) for pair in self._kv]
            new = [tuple(_left_pad(t, width, dim=2) for t in pair) for pair in kv]
            self._kv = [(torch.cat([ok, nk]), torch.cat([ov, nv]))
                        for (ok, ov), (nk, nv) in zip(old, new)]
            self._mask_BL = torch.cat([_left_pad(self._mask_BL, width, dim=1),
                                       _left_pad(mask_NL, width, dim=1)])
        with self._cond:
            self._running.extend(joining)
            self._joining = []
        self._sample_and_finish(logits_NV, first_row=len(self._running) - n)

    def _decode_step(self) -> None:
        last_B1 = torch.tensor([[r.output_ids[-1]] for r in self._running])
        mask_BL = torch.cat([self._mask_BL, torch.ones(len(self._running), 1, dtype=torch.long)], 1)
        logits_BV, self._kv = self._forward(last_B1, mask_BL, self._kv)
        self._mask_BL = mask_BL
        if self._router_hooks is not None:
            for i, r in enumerate(self._running):
                if r.return_routed_experts:
                    r.routed.append(self._routed_BLnK[i])
        self._sample_and_finish(logits_BV, first_row=0)

    def _forward(self, ids_BL, mask_BL, kv):
        from transformers import DynamicCache

        width = mask_BL.shape[1]
        # Positions count real tokens only, so a left-padded row sees the same positions
        # as the unpadded sequence would.
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)[:, width - ids_BL.shape[1]:]
        cache = DynamicCache(ddp_cache_data=kv, config=self.model.config) if kv else \
            DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids_BL, attention_mask=mask_BL, position_ids=pos_BL,
                         use_cache=True, **{self._cache_kwarg: cache})
        self.steps += 1
        new_kv = [(layer.keys, layer.values) for layer in cache.layers]  # filled in place
        if self._router_hooks is not None:
            self._routed_BLnK = self._router_hooks.take(*ids_BL.shape)
        return out.logits[:, -1, :].float(), new_kv

    def _sample_and_finish(self, logits_BV: torch.Tensor, first_row: int) -> None:
        finished: list[tuple[int, dict]] = []
        for j in range(logits_BV.shape[0]):
            i = first_row + j
            r = self._running[i]
            token, logprob = _sample(logits_BV[j], r)
            r.output_ids.append(token)
            r.logprobs.append(logprob)
            self.generated_tokens += 1
            reason = self._finish_reason(r, token)
            if reason is not None:
                finished.append((i, reason))
        if not finished:
            return
        # Out of the batch first, answered second: a client that has every answer back may
        # call /flush_cache at once, which is refused while a request still counts as
        # running (answering first made that flush a race the engine thread lost under load).
        done = [(self._running[i], reason) for i, reason in finished]
        with self._cond:
            self._drop([i for i, _ in finished])
        for r, reason in done:
            self._done(r, reason)

    def _finish_reason(self, r: Request, token: int) -> dict | None:
        p = r.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        if token in stops:
            return finish_stop(token)
        if len(r.output_ids) >= p.max_new_tokens:
            return finish_length(len(r.output_ids))
        if len(r.input_ids) + len(r.output_ids) >= self.context_length:
            return finish_length(len(r.output_ids))
        return None

    def _done(self, r: Request, reason: dict) -> None:
        r.finish_reason, r.weight_version = reason, self.weight_version
        r.on_done(r)

    def _drop(self, rows: list[int]) -> None:
        """Removes finished rows from the batch and trims all-padding cache columns."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(len(self._running)) if i not in gone]
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._kv = self._mask_BL = None
            return
        idx = torch.tensor(keep)
        mask_BL = self._mask_BL.index_select(0, idx)
        start = int((mask_BL.sum(0) > 0).nonzero()[0])
        self._mask_BL = mask_BL[:, start:]
        self._kv = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
                    for k, v in self._kv]


def _sample(logits_V: torch.Tensor, r: Request) -> tuple[int, float]:
    """One token for one request. The returned logprob is the sampled token's under the
    temperature-scaled distribution before top-k/top-p truncation (SGLang's default);
    greedy (temperature 0) reports the unscaled log-softmax."""
    p = r.params
    if p.temperature == 0 or p.top_k == 1:
        logp_V = F.log_softmax(logits_V, dim=-1)
        token = int(torch.argmax(logits_V))
        return token, float(logp_V[token])
    scaled_V = logits_V / p.temperature
    logp_V = F.log_softmax(scaled_V, dim=-1)
    if p.top_k > 0 and p.top_k < scaled_V.numel():
        kth = torch.topk(scaled_V, p.top_k).values[-1]
        scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_V, order = torch.sort(scaled_V, descending=True)
        cum = torch.softmax(sorted_V, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_V, -1) > p.top_p  # keep the token that crosses top_p
        scaled_V = scaled_V.scatter(0, order[drop], float("-inf"))
    token = int(torch.multinomial(torch.softmax(scaled_V, -1), 1, generator=r.generator))
    return token, float(logp_V[token])


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _RouterHooks:
    """Forward hooks on an HF MoE model's routers (transformers' ``Qwen3MoeTopKRouter``,
    ``mlp.gate``: its forward returns (logits, weights, top-k indices [B x L, K])) that keep
    each forward's top-k indices; dense layers' entries are 0 (the engines leave them unset)."""

    def __init__(self, model):
        cfg = model.config
        self.num_layers, self.k = cfg.num_hidden_layers, getattr(cfg, "num_experts_per_tok", 0)
        if not self.k:
            raise ValueError("--enable-return-routed-experts needs an MoE model (num_experts_per_tok)")
        self._got: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if isinstance(gate, torch.nn.Module) and not isinstance(gate, torch.nn.Linear):
                gate.register_forward_hook(self._keep(i))

    def _keep(self, layer: int):
        def hook(module, args, output):
            self._got[layer] = output[2]
        return hook

    def take(self, b: int, n: int) -> torch.Tensor:
        """[b, n, layers, K] int32 of the forward that just ran over b rows of n tokens."""
        out = torch.zeros(b, n, self.num_layers, self.k, dtype=torch.int32)
        for layer, idx in self._got.items():
            out[:, :, layer] = idx.reshape(b, n, self.k).to(torch.int32)
        self._got = {}
        return out
