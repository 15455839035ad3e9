"""What the blocking and the asyncio client share, with no I/O (as httpx's two clients share
theirs): a client's configuration, routes and session bookkeeping, what a failed unary call
means (:class:`ClientBase`), and the parts of a StepStream that do not wait
(:class:`StepStreamBase`; what a step that got no answer means is
:class:`~cache_service.client._retry.StepResends`).

Each client adds only its transport: the ``grpc`` or ``grpc.aio`` channels, its lock, its
keep-alive loop, and the waits (``time.sleep`` or ``await asyncio.sleep``). Their public
methods are one for one (``tests/service/test_client_twins.py`` compares the signatures).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, ClassVar

import grpc

from cache_service.client._channel import auth_metadata, channel_credentials, channel_options
from cache_service.client._errors import CacheError
from cache_service.client._retry import OnRetry, StepResends
from cache_service.client._routing import CallRoute, Moved, Routes
from cache_service.client._session import Carrier, SequencedCall, SessionStamp, keepalive_interval
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.backoff import Backoff


class ClientBase:
    """The state of a client over its replicas: ``target`` is ``host:port`` (cluster mode:
    several, comma-separated; calls on a pool follow the replicas' redirects to its owner,
    with one session per replica); ``token`` adds a bearer token; ``tls=True`` (or
    ``root_certificates``) uses TLS. With ``session`` (the default) the first mutating call
    on a replica opens a session there that the client keeps alive in the background."""

    #: The module whose ``secure_channel`` / ``insecure_channel`` make the channels
    #: (``grpc`` or ``grpc.aio``).
    _grpc: ClassVar[Any] = grpc

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None, session: bool = True,
                 client_name: str = "", attempt_timeout: float = 2.0) -> None:
        self._backoff = Backoff(backoff_base, backoff_max)
        options = channel_options(max_retries, self._backoff, ssl_target_name_override)
        creds = channel_credentials(tls, root_certificates)
        #: The channel to each address, opened on first use (the first seed's at once).
        self._channels: dict[str, Any] = {}

        def open_stub(address: str) -> pb_grpc.CacheServiceStub:
            channel = (self._grpc.secure_channel(address, creds, options=options) if creds
                       else self._grpc.insecure_channel(address, options=options))
            self._channels[address] = channel
            return pb_grpc.CacheServiceStub(channel)

        #: Replicas and learned pool owners (cluster mode: several, comma-separated).
        self._routes = Routes(target, open_stub)
        self._routes.stub(self._routes.seeds[0])  # the first seed's channel connects now
        self._metadata = auth_metadata(token)
        self.default_timeout = default_timeout
        #: The first attempt's deadline of a call that is safe to resend (doubled on each
        #: resend; see :class:`CallRoute`): a hung replica costs a call about this long.
        self.attempt_timeout = attempt_timeout
        self._retries = max_retries
        self._use_session = session
        self._client_name = client_name
        #: One session per replica (sessions live in a replica's state), by address.
        self._sessions: dict[str, SessionStamp] = {}
        self._carrier = Carrier()  # sessions carried over a failover
        self._init_transport()

    def _init_transport(self) -> None:
        """What the client adds to wait and keep alive: its lock (one mutating call at a
        time: sequence numbers) and its keep-alive state."""
        raise NotImplementedError

    @property
    def session_id(self) -> str | None:
        """The id of the session open on the first seed replica (None before the first
        mutating call, or without sessions)."""
        session = self._sessions.get(self._routes.address())
        return session.session_id if session else None

    def _channel(self, address: str | None) -> Any:
        """The channel to ``address`` (default: the first seed), opened if it was not."""
        address = address or self._routes.seeds[0]
        self._routes.stub(address)
        return self._channels[address]

    def _take_sessions(self) -> list[tuple[str, SessionStamp]]:
        """Every session the client holds, as (address, session), forgotten here: closing
        the client ends them at the server."""
        sessions = list(self._sessions.items()) + [
            (address, session) for (address, _), session in self._carrier.adopted.items()]
        self._sessions, self._carrier.adopted = {}, {}
        return sessions

    def _route(self, request: Any, timeout: float | None, pin: str | None,
               resend: bool) -> CallRoute:
        """The route of one unary call (see :meth:`_unary_delay`)."""
        return CallRoute(self._routes, getattr(request, "pool_id", ""),
                         timeout or self.default_timeout, self._backoff, pin,
                         resend=resend and self._retries > 0,
                         attempt_timeout=self.attempt_timeout)

    @staticmethod
    def _pin_request(pool_id: str, pin_id: str, token_ids: Sequence[int],
                     block_hashes: Sequence[bytes], ttl_seconds: float, session_id: str,
                     outlive_session: bool, cache_salt: str | None, lora_name: str | None,
                     lora_path: str | None, mm_items: Sequence[tuple[str, int, int]] = (),
                     prompt_embeds_digests: Sequence[bytes] = ()) -> pb.PinPrefixRequest:
        """The PinPrefixRequest of ``pin_prefix``."""
        req = pb.PinPrefixRequest(
            pool_id=pool_id, pin_id=pin_id, token_ids=token_ids, block_hashes=block_hashes,
            ttl_seconds=ttl_seconds, session_id=session_id, outlive_session=outlive_session,
            cache_salt=cache_salt or "", lora_name=lora_name or "", lora_path=lora_path or "",
            prompt_embeds_digests=prompt_embeds_digests)
        for identifier, offset, length in mm_items:
            req.mm_items.add(identifier=identifier, offset=offset, length=length)
        return req

    @staticmethod
    def _unary_delay(route: CallRoute, address: str, exc: grpc.RpcError) -> float:
        """After a unary attempt at ``address`` failed with ``exc``: seconds to wait before
        the next attempt (at the route's next address); raises :class:`Moved` (a pinned
        call must go elsewhere) or the call's :class:`CacheError` (giving up)."""
        error, trailers = CacheError.from_rpc(exc), exc.trailing_metadata()
        if error.code == grpc.StatusCode.UNAVAILABLE or (
                error.code == grpc.StatusCode.CANCELLED and route.resend):
            # (CANCELLED: a server that stopped with the call in flight; this client
            # never cancels a unary call itself)
            return route.unavailable(address, error, trailers)
        if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return route.expired(address, error)
        raise error

    def _open_session_request(self) -> pb.OpenSessionRequest:
        """OpenSession with an id proposed here: that makes it safe to resend (a resend
        whose first answer was lost answers the same session: no second one, no lazily
        failed call)."""
        return pb.OpenSessionRequest(client_name=self._client_name,
                                     session_id=secrets.token_hex(16))

    def _session_opened(self, address: str, resp: pb.OpenSessionResponse) -> SessionStamp:
        """Keeps (and keeps alive) the session ``address`` opened for this client."""
        session = self._sessions[address] = SessionStamp(resp.session_id,
                                                         resp.lease_ttl_seconds)
        self._start_keepalive(session, address)
        return session

    def _start_keepalive(self, session: SessionStamp, address: str, *,
                         now: bool = False) -> None:
        """Keeps ``session`` alive at ``address``; ``now``: the first KeepAlive at once."""
        raise NotImplementedError

    def _keepalive_plan(self, session: SessionStamp,
                        address: str) -> tuple[float, pb.KeepAliveRequest, Any]:
        """(interval, request, stub) of ``session``'s keep-alive at ``address``."""
        return (keepalive_interval(session.lease_ttl_seconds),
                pb.KeepAliveRequest(session_id=session.session_id),
                self._routes.stub(address))

    def _sequenced_call(self, request: Any,
                        timeout: float | None) -> tuple[CallRoute, SequencedCall]:
        """The route over the replicas and the session bookkeeping of one mutating call
        (see the clients' ``_sequenced``)."""
        route = CallRoute(self._routes, getattr(request, "pool_id", ""),
                          timeout or self.default_timeout, self._backoff)
        return route, SequencedCall(self._sessions, self._carrier, route.pool_id)

    @staticmethod
    def _unsent_delay(route: CallRoute, call: SequencedCall, address: str,
                      session: SessionStamp | None, exc: Moved | CacheError) -> float:
        """A mutating call sent to ``address`` under ``session`` got ``exc`` instead of an
        answer: seconds to wait before it is restamped and sent again (to the route's next
        address); raises ``exc`` when the call ends with it."""
        if isinstance(exc, Moved):
            call.moved(address, session, exc)
            return route.moved(exc)
        if call.failed(address, session, exc):
            return 0.0
        raise exc

    def _accepted(self, call: SequencedCall, address: str,
                  session: SessionStamp | None) -> None:
        """``address`` answered ``call`` under ``session``: settles its number and keeps
        alive the sessions that now need it there."""
        for stamp in call.accepted(address, session) if session is not None else ():
            self._start_keepalive(stamp, address, now=stamp is not session)

    def _subscribe_failed(self, pool_id: str, exc: grpc.RpcError, delivered: bool) -> None:
        """An event stream of ``pool_id`` ended with ``exc``: returns when it is to be
        opened again at the owner a redirect named (nothing delivered yet), else raises
        the :class:`CacheError`."""
        if (delivered or exc.code() != grpc.StatusCode.UNAVAILABLE
                or not self._routes.follow(pool_id, exc.trailing_metadata())):
            raise CacheError.from_rpc(exc) from None


class StepStreamBase:
    """What both StepStreams keep: the client, each step's deadline (``step_timeout``), the
    ``on_retry(reason, attempt)`` hook, and the open call with its replica's address."""

    def __init__(self, client: Any, step_timeout: float,
                 on_retry: OnRetry | None = None) -> None:
        self._client = client
        self.step_timeout = step_timeout
        self._on_retry = on_retry
        self._call: Any = None
        self._address = ""

    def _resends(self, pool_id: str) -> StepResends:
        """The resend budget of one step on ``pool_id`` (the client's ``max_retries``)."""
        client = self._client
        return StepResends(client._routes, pool_id, self.step_timeout, client._retries,
                           client._backoff, self._on_retry)

    @staticmethod
    def _request(pool_id: str, step_ops: Sequence[pb.Op], begin_step: bool) -> pb.StepRequest:
        """The StepRequest of :meth:`step` (stamped later, with the session)."""
        return pb.StepRequest(pool_id=pool_id, begin_step=begin_step, ops=step_ops)
