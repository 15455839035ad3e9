"""The blocking and the asyncio client are twins (``cache_service/client/_base.py``): the
same public methods with the same parameters, on both clients and both StepStreams, and
the methods they gained for the tools (``list_sessions``, ``wait_connected``) answer alike
against a real server."""

from __future__ import annotations

import asyncio
import inspect
import re
from typing import Any

import pytest

from cache_service.client import (
    AsyncCacheClient,
    AsyncStepStream,
    CacheClient,
    CacheError,
    StepStream,
    ops,
)
from kvcache_common.launch import ServerProcess

from .builders import full_layers, pool_options

#: The context-manager methods of each side, by the name of their twin on the other side.
ASYNC_NAMES = {"__aenter__": "__enter__", "__aexit__": "__exit__"}


def public_api(cls: type) -> dict[str, Any]:
    """The public members of ``cls`` (context-manager methods under the blocking names)."""
    out = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name not in ("__init__", "__enter__", "__exit__",
                                                 "__aenter__", "__aexit__"):
            continue
        out[ASYNC_NAMES.get(name, name)] = member
    return out


def shape(member: Any) -> str:
    """A member's signature with what only says "async" taken out (``AsyncStepStream``
    -> ``StepStream``, ``AsyncIterator`` -> ``Iterator``)."""
    if isinstance(member, property):
        member = member.fget
    return re.sub(r"\bAsync(?=[A-Z])", "", str(inspect.signature(member)))


@pytest.mark.parametrize(("sync", "asynchronous"), [(CacheClient, AsyncCacheClient),
                                                    (StepStream, AsyncStepStream)])
def test_the_twins_have_the_same_public_methods_and_signatures(sync: type,
                                                               asynchronous: type) -> None:
    blocking, aio = public_api(sync), public_api(asynchronous)
    assert {"__init__", "__enter__", "__exit__", "close", "step", "step_raw"} <= set(blocking)
    assert sorted(blocking) == sorted(aio)
    for name, member in blocking.items():
        if name == "__init__" or callable(member) or isinstance(member, property):
            assert shape(member) == shape(aio[name]), name
        if not name.startswith("__"):
            assert inspect.getdoc(member) and inspect.getdoc(aio[name]), f"{name}: no docstring"


def test_every_async_method_is_awaited_where_its_twin_blocks() -> None:
    """A method of the asyncio side is a coroutine (an async iterator for events) unless it
    only builds an object (``step_stream``) or reads state (``session_id``)."""
    for sync, asynchronous in ((CacheClient, AsyncCacheClient),
                               (StepStream, AsyncStepStream)):
        for name, member in public_api(asynchronous).items():
            if name == "__init__" or not inspect.isfunction(member):
                continue
            if name == "subscribe_events":
                assert inspect.isasyncgenfunction(member)
            elif name == "step_stream":
                assert not inspect.iscoroutinefunction(member)
            else:
                assert inspect.iscoroutinefunction(member), name
            assert not inspect.iscoroutinefunction(public_api(sync)[name]), name


def test_list_sessions_and_wait_connected_answer_alike_on_both_clients(
        server: ServerProcess) -> None:
    """Each client's session shows in both clients' ListSessions, with the pool its
    requests are in; both wait for a connected channel and time out on an address where
    nothing listens."""
    with CacheClient(server.target, default_timeout=20, client_name="twin-sync") as client:
        client.wait_connected(10)
        client.register_pool("twins", full_layers(), **pool_options())
        client.step("twins", [ops.add("s", [1, 2, 3]), ops.allocate("s", 3)])

        async def run() -> tuple[Any, Any]:
            async with AsyncCacheClient(server.target, default_timeout=20,
                                        client_name="twin-async") as aclient:
                await aclient.wait_connected(10)
                await aclient.step("twins", [ops.add("a", [4, 5]), ops.allocate("a", 2)])
                return await aclient.list_sessions(), client.list_sessions()

        from_async, from_sync = asyncio.run(run())
        for answer in (from_async, from_sync):
            by_name = {s.client_name: s for s in answer.sessions}
            assert {"twin-sync", "twin-async"} <= set(by_name)
            assert [p.pool_id for p in by_name["twin-sync"].pools] == ["twins"]
            assert client.session_id is not None
            assert client.session_id.startswith(by_name["twin-sync"].session_id_prefix)
            assert by_name["twin-sync"].last_sequence == 2  # RegisterPool, Step
        client.delete_pool("twins")


def test_wait_connected_times_out_where_nothing_listens() -> None:
    with CacheClient("127.0.0.1:1") as client, pytest.raises(CacheError) as sync_err:
        client.wait_connected(0.3)

    async def run() -> CacheError:
        async with AsyncCacheClient("127.0.0.1:1") as aclient:
            with pytest.raises(CacheError) as err:
                await aclient.wait_connected(0.3)
            return err.value

    for err in (sync_err.value, asyncio.run(run())):
        assert err.code.name == "DEADLINE_EXCEEDED" and "0.3 s" in err.message
