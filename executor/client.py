"""A small typed client of ``kvcache.v1.ExecutorService`` (used by the demo, the benchmark
and the tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict, Unpack

import grpc

from kvcache_common.api.kvcache.v1 import executor_pb2 as epb
from kvcache_common.api.kvcache.v1 import executor_pb2_grpc as epb_grpc


@dataclass
class Generation:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    time_to_first_token_s: float = 0.0
    num_preemptions: int = 0
    total_time_s: float = 0.0


class GenerateOptions(TypedDict, total=False):
    """The optional keywords of :func:`generate_request` (what ``generate`` passes on)."""

    request_id: str
    temperature: float
    seed: int
    top_k: int
    top_p: float
    stop_token_ids: Sequence[int]
    cache_salt: str


def generate_request(prompt: Sequence[int], max_tokens: int, *, request_id: str = "",
                     temperature: float = 0.0, seed: int = 0, top_k: int = 0, top_p: float = 0.0,
                     stop_token_ids: Sequence[int] = (),
                     cache_salt: str = "") -> epb.GenerateRequest:
    """A GenerateRequest (``temperature`` 0: greedy; ``top_k`` 0 and ``top_p`` 0: no cut)."""
    return epb.GenerateRequest(
        request_id=request_id, prompt_token_ids=list(prompt), max_tokens=max_tokens,
        stop_token_ids=list(stop_token_ids), cache_salt=cache_salt,
        sampling=epb.SamplingParams(temperature=temperature, seed=seed, top_k=top_k, top_p=top_p))


def _collect(gen: Generation, msg: epb.GenerateResponse) -> None:
    gen.request_id = msg.request_id
    gen.token_ids.extend(msg.token_ids)
    if msg.finish_reason:
        gen.finish_reason = msg.finish_reason
        s = msg.stats
        gen.prompt_tokens, gen.cached_tokens = s.prompt_tokens, s.cached_tokens
        gen.time_to_first_token_s, gen.num_preemptions = s.time_to_first_token_s, s.num_preemptions
        gen.total_time_s = s.total_time_s


class ExecutorClient:
    """Blocking client."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = epb_grpc.ExecutorServiceStub(self.channel)

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def generate(self, prompt: Sequence[int], max_tokens: int, *, timeout: float = 120.0,
                 **kwargs: Unpack[GenerateOptions]) -> Generation:
        """Runs one request to the end; answers its tokens, finish reason and stats."""
        gen = Generation("")
        request = generate_request(prompt, max_tokens, **kwargs)
        for msg in self.stub.Generate(request, timeout=timeout):
            _collect(gen, msg)
        return gen

    def info(self) -> epb.GetInfoResponse:
        """The executor's model, pool and readiness."""
        return self.stub.GetInfo(epb.GetInfoRequest(), timeout=10)

    def execute(self, request: epb.ExecuteRequest, timeout: float = 60.0) -> epb.ExecuteResponse:
        """One raw forward pass over the caller's sequences (and, if asked, their next-token
        logits)."""
        return self.stub.Execute(request, timeout=timeout)


class AsyncExecutorClient:
    """asyncio client (many concurrent Generate streams on one channel)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = epb_grpc.ExecutorServiceStub(self.channel)

    async def close(self) -> None:
        """Closes the channel."""
        await self.channel.close()

    async def generate(self, prompt: Sequence[int], max_tokens: int, *, timeout: float = 300.0,
                       **kwargs: Unpack[GenerateOptions]) -> Generation:
        """Runs one request to the end; answers its tokens, finish reason and stats."""
        gen = Generation("")
        call = self.stub.Generate(generate_request(prompt, max_tokens, **kwargs), timeout=timeout)
        async for msg in call:
            _collect(gen, msg)
        return gen
