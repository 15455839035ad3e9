"""The open services that probes and generic clients use without a token: health
(``grpc.health.v1.Health`` with Check, Watch and List) and server reflection, served as both
``grpc.reflection.v1`` (what grpcurl and current clients ask first) and
``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection ships only v1alpha. The v1 protocol has the same messages under another
package, so v1 is served by the same servicer with the v1alpha message codec, and its file
descriptor is derived from v1alpha's (package renamed) so that reflection can describe it.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = reflection.SERVICE_NAME
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class HealthServicer(health.aio.HealthServicer):
    """grpcio-health-checking's servicer plus ``List`` (the status of every service)."""

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        """The serving status of every service registered with this servicer."""
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()})


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Adds grpc.reflection.v1's file descriptor (v1alpha's, renamed) to ``pool``."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name = _V1_FILE
    proto.package = "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # scalars have none; setting "" would add one
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serves reflection v1 and v1alpha for ``service_names`` (and themselves)."""
    _add_v1_descriptor(descriptor_pool.Default())
    names = (*service_names, V1, V1ALPHA)
    servicer = reflection.aio.ReflectionServicer(names)
    codec = dict(request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                 response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(name, {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo, **codec)})
        for name in (V1, V1ALPHA)])
