"""Every bad byte a clean error: undecodable messages, auth before parsing, the request id in
the trailers of failed calls, and the open services (reflection v1 + v1alpha, health List)."""

from __future__ import annotations

import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.client import CacheClient
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.launch import ServerProcess, start_cache_service
from tests.metrics_text import scrape, value

SERVICE = "/kvcache.v1.CacheService/"
UNARY = ["RegisterPool", "GetPool", "ListPools", "DeletePool", "Step", "PeekPrefix",
         "GetRequest", "GetPoolStats", "ResetPrefixCache"]
# Field 1 (a string in every request that has one) holding bytes that are not UTF-8, and
# a length prefix running past the end of the message.
BAD_UTF8 = b"\x0a\x02\xff\xfe"
TRUNCATED = b"\x0a\x7fabc"


def raw_unary(channel: grpc.Channel, method: str):
    return channel.unary_unary(SERVICE + method)  # bytes in, bytes out


def trailer(err: grpc.RpcError, key: str) -> str | None:
    return dict(err.trailing_metadata() or ()).get(key)


def undecodable_count(server: ServerProcess, method: str) -> float:
    """Messages of ``method`` the server could not decode (0 before the first)."""
    return value(scrape(server.metrics_port), "kvcache_undecodable_messages_total",
                 default=0.0, grpc_method=method, grpc_service="kvcache.v1.CacheService")


@pytest.mark.parametrize("method", UNARY)
@pytest.mark.parametrize("payload", [BAD_UTF8, TRUNCATED], ids=["bad-utf8", "truncated"])
def test_undecodable_messages_are_invalid_argument_counted_with_the_request_id(
        server: ServerProcess, client: CacheClient, method: str, payload: bytes) -> None:
    if method == "ListPools" and payload == BAD_UTF8:
        payload = b"\x0a\x02\xff\xfe"  # an unknown field: decodes fine (proto3 skips it)
        expected = grpc.StatusCode.OK
    else:
        expected = grpc.StatusCode.INVALID_ARGUMENT
    pools_before = client.list_pools()
    count = undecodable_count(server, method)
    with grpc.insecure_channel(server.target) as channel:
        call = raw_unary(channel, method)
        if expected == grpc.StatusCode.OK:
            call(payload, timeout=10)
            return
        with pytest.raises(grpc.RpcError) as err:
            call(payload, timeout=10, metadata=(("x-request-id", f"bad-{method}-{len(payload)}"),))
    assert err.value.code() == expected, err.value.details()
    assert "not a valid" in err.value.details()
    assert trailer(err.value, "x-request-id") == f"bad-{method}-{len(payload)}"
    assert undecodable_count(server, method) == count + 1
    record = server.wait_for(lambda r: r.get("event") == "undecodable_message"
                             and r.get("request_id") == f"bad-{method}-{len(payload)}", timeout=10)
    assert record["rpc"] == f"kvcache.v1.CacheService/{method}"
    assert client.list_pools() == pools_before


def test_an_undecodable_message_in_a_step_stream_ends_it_with_invalid_argument(
        server: ServerProcess, new_pool) -> None:
    pool = new_pool().pool_id
    good = pb.StepRequest(pool_id=pool, begin_step=True).SerializeToString()
    with grpc.insecure_channel(server.target) as channel:
        stream = channel.stream_stream(SERVICE + "StepStream")
        responses = stream(iter([good, TRUNCATED, good]), timeout=10,
                           metadata=(("x-request-id", "bad-stream"),))
        assert next(responses)  # the first, valid message is answered
        with pytest.raises(grpc.RpcError) as err:
            next(responses)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailer(err.value, "x-request-id") == "bad-stream"


def test_failed_calls_carry_the_request_id_in_their_trailers(server: ServerProcess,
                                                             stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.GetPool(pb.GetPoolRequest(pool_id="nope"), timeout=10,
                     metadata=(("x-request-id", "find-me"),))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert trailer(err.value, "x-request-id") == "find-me"
    assert trailer(err.value, "grpc-status-details-bin") is not None  # still rich
    with pytest.raises(grpc.RpcError) as err:  # no id sent: the server makes one
        stub.GetPool(pb.GetPoolRequest(pool_id="nope"), timeout=10)
    assert re.fullmatch(r"[0-9a-f]{32}", trailer(err.value, "x-request-id") or "")


@pytest.fixture(scope="module")
def token_server():
    srv = start_cache_service("--metrics-port", "0", env={"KVCACHE_AUTH_TOKEN": "s3cret"})
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("payload", [TRUNCATED, b"\xff" * 1024],
                         ids=["truncated", "garbage"])
def test_auth_is_checked_before_the_body_is_parsed(token_server: ServerProcess,
                                                   payload: bytes) -> None:
    count = undecodable_count(token_server, "Step")
    with grpc.insecure_channel(token_server.target) as channel, \
            pytest.raises(grpc.RpcError) as err:
        raw_unary(channel, "Step")(payload, timeout=10,
                                   metadata=(("x-request-id", "no-token"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert trailer(err.value, "x-request-id") == "no-token"
    assert undecodable_count(token_server, "Step") == count  # never parsed


def test_reflection_v1_and_v1alpha_are_both_served(server: ServerProcess) -> None:
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    request = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    describe = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="grpc.reflection.v1.ServerReflection").SerializeToString()
    with grpc.insecure_channel(server.target) as channel:
        for version in ("v1", "v1alpha"):
            info = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            listed, described = list(info(iter([request, describe]), timeout=10))
            names = {s.name for s in listed.list_services_response.service}
            assert {"kvcache.v1.CacheService", "grpc.health.v1.Health",
                    "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection"} <= names
            files = described.file_descriptor_response.file_descriptor_proto
            assert files, described
    from google.protobuf import descriptor_pb2
    proto = descriptor_pb2.FileDescriptorProto.FromString(files[0])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    method = pool.FindServiceByName("grpc.reflection.v1.ServerReflection").methods[0]
    assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"


def test_health_list_reports_every_service(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(),
                                                         timeout=10)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert {name: s.status for name, s in reply.statuses.items()} == {
        "": serving, "kvcache.v1.CacheService": serving}


@pytest.mark.parametrize("method", ["/grpc.health.v1.Health/Check",
                                    "/grpc.health.v1.Health/List",
                                    "/grpc.health.v1.Health/Watch",
                                    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                    "/grpc.reflection.v1alpha.ServerReflection/"
                                    "ServerReflectionInfo"])
def test_the_open_services_answer_bad_bytes_with_invalid_argument(server: ServerProcess,
                                                                  method: str) -> None:
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as err:
        if method.endswith("ServerReflectionInfo"):
            list(channel.stream_stream(method)(iter([TRUNCATED]), timeout=10))
        elif method.endswith("Watch"):
            list(channel.unary_stream(method)(TRUNCATED, timeout=10))
        else:
            channel.unary_unary(method)(TRUNCATED, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "not a valid" in err.value.details()
