"""Spreads generation requests over engine replicas: least in-flight first, sticky per trajectory.

Multi-turn requests of one trajectory go to the replica that served its previous turn (an LRU map
of trajectory id → replica), so they reuse that replica's prefix cache. A replica that cannot be
reached is marked dead at once: it gets no new requests, each of its failing requests is retried
on another replica (from the start: partial output is lost), and a health check revives it when
it answers again.

With `resume_aborted`, a sample the engine aborted (a pause in abort mode across a weight update) is
resubmitted as prompt + its tokens so far with the budget left, until it ends otherwise; the caller
gets one result (tokens, log-probs and weight-version spans joined), as slime
(`rollout/sglang_rollout.py::generate`) and AReaL (`engine/sglang_remote.py::agenerate`) resume. A
resubmission that reaches a paused engine waits there until `continue_generation`. Each of `n`
samples is resubmitted on its own. Only SGLang's own abort messages are resumed (an engine failure is
not retried forever), and not samples whose rid the router's own `abort` matched.

Health loop (`start_health_checks`): every `health_interval_s` it polls each replica's
/health_generate; it runs until `close()` cancels it.

LoRA adapters (`use_adapter`): every /generate the router sends from then on, resubmissions and retries included,
carries `lora_path=<the current adapter>` (None: the base model); the trainer has loaded it on every replica
(`megarl.engines.weights.adapters.load_adapter`). The router counts its in-flight requests per adapter. An adapter
is retired one switch after it stopped being current (the adapter before the previous one): once none of its
requests is in flight (at once, or when the last one answers) a task unloads it from every live replica
(`EngineClient.unload_lora_adapter`; a replica that no longer holds it counts as done), which SGLang answers once
the requests naming it have ended. Those tasks wait only for the replicas' answers; `retirements()` waits for the
ones started, `close()` too before closing the sessions. The lag of one switch covers several routers over the
same replicas (rollout.num_agent_workers > 1): the driver switches them all before the next sync
(`RolloutManager.use_adapter`), so when one router retires an adapter, no router still sends new requests naming it.
"""

import asyncio
import collections
import dataclasses
import logging
from dataclasses import dataclass

from megarl.config.rollout import RolloutConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import ClientTimeouts, EngineClient, EngineError, EngineUnavailable
from megarl.engines.client.fleet import Fleet
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import ABORTED, ABORTED_WAITING, FinishReason, GenerateResult

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Replica:
    client: EngineClient
    in_flight: int = 0
    served: int = 0
    """Requests completed here."""
    alive: bool = True


@dataclass(kw_only=True, slots=True)
class _Request:
    """One `Router.generate` call's arguments, as each (re)submission of it sends them."""

    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    trajectory_id: str | None
    rid: str | None
    return_routed_experts: bool
    routed_experts_start_len: int
    image_data: list[str] | None = None
    """A vision-language prompt's images, in order (`EngineClient.generate`)."""
    expanded_tokens: int = 0
    """Tokens the engine's expansion of the image placeholders adds to `input_ids` (`EngineClient.generate`)."""


class NoReplicaAvailable(RuntimeError):
    """Every replica is dead."""


class Router:
    def __init__(
        self,
        clients: list[EngineClient],
        sticky_capacity: int = 100_000,
        health_interval_s: float = 10.0,
        resume_aborted: bool = False,
    ) -> None:
        if not clients:
            raise ValueError("the router needs at least one engine replica")
        self.replicas = [Replica(client=c) for c in clients]
        self.sticky_capacity = sticky_capacity
        self.health_interval_s = health_interval_s
        self.resume_aborted = resume_aborted
        """Resubmit aborted samples with their partial output (pause_generation in abort mode)."""
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._health_task: asyncio.Task | None = None
        self._aborted: list[str] = []
        """The rid prefixes `abort` was called with, in order ("" = all): those requests are not resumed."""
        self.retried_requests = 0
        """Requests sent again to another replica because theirs went down."""
        self.adapter: str | None = None
        """The LoRA adapter every new request names (`use_adapter`); None = the base model."""
        self._adapter_requests: collections.Counter[str | None] = collections.Counter()
        """In-flight /generate calls per adapter."""
        self._previous: str | None = None
        """The adapter current before `adapter`: kept loaded until the next switch (other routers may lag one)."""
        self._retired: set[str] = set()
        """Adapters no longer current whose requests are still in flight."""
        self._retirements: set[asyncio.Task] = set()

    @classmethod
    def from_config(
        cls, cfg: RolloutConfig, urls: list[str], keys: EngineKeys | None = None, resume_aborted: bool = False
    ) -> "Router":
        """Clients with `rollout.request_timeout_s` per /generate; health checks every `health_check_interval_s`."""
        fleet = Fleet.connect(urls, keys, ClientTimeouts(generate_s=cfg.request_timeout_s))
        return cls(fleet.clients, health_interval_s=cfg.health_check_interval_s, resume_aborted=resume_aborted)

    def pick(self, trajectory_id: str | None = None) -> int:
        """The replica index for the next request: the trajectory's own if alive, else the least loaded."""
        if trajectory_id is not None and trajectory_id in self._sticky:
            index = self._sticky[trajectory_id]
            if self.replicas[index].alive:
                self._sticky.move_to_end(trajectory_id)
                return index
        alive = [i for i, r in enumerate(self.replicas) if r.alive]
        if not alive:
            raise NoReplicaAvailable(f"all {len(self.replicas)} engine replicas are down: {self._urls()}")
        index = min(alive, key=lambda i: (self.replicas[i].in_flight, self.replicas[i].served))
        if trajectory_id is not None:
            self._sticky[trajectory_id] = index
            self._sticky.move_to_end(trajectory_id)
            while len(self._sticky) > self.sticky_capacity:
                self._sticky.popitem(last=False)
        return index

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        return_logprob: bool = False,
        trajectory_id: str | None = None,
        rid: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        image_data: list[str] | None = None,
        expanded_tokens: int = 0,
    ) -> list[GenerateResult]:
        """`sampling.n` samples from one replica; retried on another if that replica goes down (`image_data`: a
        vision-language prompt's images, `input_ids` then with one placeholder per image, which the engine's
        expansion lengthens by `expanded_tokens`). With
        `resume_aborted`, each sample the engine aborted is resubmitted until it ends otherwise.

        With `return_routed_experts`, each result's `routed_experts` holds int32 [rows, num_hidden_layers *
        num_experts_per_tok] for prompt ‖ output positions [routed_experts_start_len, prompt + output - 1) (see
        `GenerateResult.routed_experts`); a resumed sample's rows are joined across its resubmissions, the same
        rows one uninterrupted request would return. It stays None on engines launched without
        `--enable-return-routed-experts` (`rollout.return_routed_experts`)."""
        since = len(self._aborted)
        request = _Request(
            input_ids=input_ids,
            sampling=sampling,
            return_logprob=return_logprob,
            trajectory_id=trajectory_id,
            rid=rid,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
            image_data=image_data,
            expanded_tokens=expanded_tokens,
        )
        results = await self._generate_once(request)
        if not self.resume_aborted:
            return results
        sample_rids = [None if rid is None else f"{rid}-{i}" for i in range(len(results))]
        resumed = [
            self._resume(result, dataclasses.replace(request, rid=sample_rid), since)
            for result, sample_rid in zip(results, sample_rids, strict=True)
        ]
        return list(await asyncio.gather(*resumed))

    async def _resume(self, result: GenerateResult, request: _Request, since: int) -> GenerateResult:
        """While `result` ended aborted by a pause or /abort_request (and no `abort` of this router's since its
        `since`-th matched `request.rid`): send prompt + its output so far as rid `{rid}-resume{k}` with
        max_new_tokens reduced by that output (nothing left: it ends as "length") and routed experts asked from the
        first row it lacks, and join the continuation to it.

        Consumes the aborted result; waits for each resubmission, which a paused engine holds at its gate until
        `continue_generation`; ends when a piece ends otherwise, the budget is spent or the router aborted it."""
        while self._resumable(result) and not self._cancelled(request.rid, since):
            budget = request.sampling.max_new_tokens - len(result.output_ids)
            if budget <= 0:
                length = FinishReason(type="length", length=len(result.output_ids))
                return dataclasses.replace(result, finish_reason=length)
            more = dataclasses.replace(
                request,
                input_ids=request.input_ids + result.output_ids,
                sampling=dataclasses.replace(request.sampling, max_new_tokens=budget, n=1),
                rid=None if request.rid is None else f"{request.rid}-resume{result.num_resumes + 1}",
                routed_experts_start_len=result.next_routed_experts_start_len,
            )
            [continuation] = await self._generate_once(more)
            result = result.extended(continuation)
        return result

    @staticmethod
    def _resumable(result: GenerateResult) -> bool:
        """Aborted with SGLang's messages for an abort of a running or queued request (a pause in abort mode)."""
        return result.finish_reason.type == "abort" and result.finish_reason.message in (ABORTED, ABORTED_WAITING)

    def _cancelled(self, rid: str | None, since: int) -> bool:
        """Whether a call of `abort` after the first `since` matched `rid` ("" matches every rid and None)."""
        return any((rid or "").startswith(prefix) for prefix in self._aborted[since:])

    async def _generate_once(self, request: _Request) -> list[GenerateResult]:
        """One /generate on the picked replica with the current adapter, retried on another if it goes down."""
        while True:
            index, adapter = self.pick(request.trajectory_id), self.adapter
            replica = self.replicas[index]
            replica.in_flight += 1
            self._adapter_requests[adapter] += 1
            try:
                results = await replica.client.generate(
                    request.input_ids,
                    request.sampling,
                    request.return_logprob,
                    request.rid,
                    request.return_routed_experts,
                    request.routed_experts_start_len,
                    lora_path=adapter,
                    image_data=request.image_data,
                    expanded_tokens=request.expanded_tokens,
                )
            except EngineUnavailable as e:
                self._mark_dead(index, e)
                self.retried_requests += 1
                continue
            finally:
                replica.in_flight -= 1
                self._adapter_requests[adapter] -= 1
                self._retire_idle()
            replica.served += 1
            return results

    def use_adapter(self, name: str | None) -> None:
        """From now on every request (resubmissions included) names LoRA adapter `name` (None: the base model); the
        one before the previous is retired: unloaded from every replica once none of its requests is in flight. Call
        it on the router's event loop."""
        if name == self.adapter:
            return
        if self._previous is not None and self._previous != name:
            self._retired.add(self._previous)
        if name is not None:
            self._retired.discard(name)
        self._previous, self.adapter = self.adapter, name
        self._retire_idle()

    def _retire_idle(self) -> None:
        for name in [n for n in self._retired if not self._adapter_requests[n]]:
            self._retired.discard(name)
            del self._adapter_requests[name]
            task = asyncio.get_running_loop().create_task(self._unload(name))
            self._retirements.add(task)
            task.add_done_callback(self._retirements.discard)

    async def _unload(self, name: str) -> None:
        """Unload `name` from every live replica; one that does not hold it (another router unloaded it, or it
        restarted since) counts as done, other failures are logged."""
        results = await asyncio.gather(
            *(r.client.unload_lora_adapter(name) for r in self.replicas if r.alive), return_exceptions=True
        )
        for error in results:
            if isinstance(error, BaseException) and not _not_held(error):
                logger.warning("unloading LoRA adapter %s failed: %s", name, error)

    async def retirements(self) -> None:
        """Wait until the unloads started so far have answered."""
        await asyncio.gather(*self._retirements)

    async def abort(self, rid_prefix: str = "", abort_all: bool = False) -> None:
        """Abort matching requests on every live replica; they are not resumed."""
        self._aborted.append("" if abort_all else rid_prefix)
        await asyncio.gather(*(r.client.abort_request(rid_prefix, abort_all) for r in self.replicas if r.alive))

    def _mark_dead(self, index: int, error: Exception) -> None:
        replica = self.replicas[index]
        if replica.alive:
            replica.alive = False
            logger.warning(
                "engine replica %d (%s) is down (%s); draining it: %d in-flight requests retry on %d other replicas",
                index,
                replica.client.url,
                error,
                replica.in_flight,
                sum(r.alive for r in self.replicas),
            )

    async def check_health(self) -> None:
        """Poll every replica once; mark the silent ones dead and revive the ones that answer again."""
        healthy = await asyncio.gather(*(r.client.health(timeout_s=30.0) for r in self.replicas))
        for index, (replica, ok) in enumerate(zip(self.replicas, healthy, strict=True)):
            if not ok:
                self._mark_dead(index, EngineUnavailable("health check failed"))
            elif not replica.alive:
                replica.alive = True
                logger.info("engine replica %d (%s) is healthy again", index, replica.client.url)

    def start_health_checks(self) -> None:
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def close(self) -> None:
        """Stop the health loop, wait for the adapter unloads under way, close the sessions."""
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        await self.retirements()
        await asyncio.gather(*(r.client.close() for r in self.replicas))

    def _urls(self) -> list[str]:
        return [r.client.url for r in self.replicas]


def _not_held(error: BaseException) -> bool:
    """An unload refused because the replica has no such adapter (lora_registry.py::LoRARegistry.unregister)."""
    return isinstance(error, EngineError) and "does not exist" in str(error)
