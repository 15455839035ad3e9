"""A client that knows nothing of the project's stubs: it discovers the services by server
reflection and calls them with messages built at run time from the discovered descriptors
(as grpcurl does). It runs in a fresh interpreter that never imports ``cache_service``."""

from __future__ import annotations

import json
import subprocess
import sys

from kvcache_common.launch import ServerProcess

DYNAMIC_CLIENT = r'''
import json, sys
import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

channel = grpc.insecure_channel(sys.argv[1])
db = ProtoReflectionDescriptorDatabase(channel)
services = sorted(db.get_services())
pool = descriptor_pool.DescriptorPool(db)
service = pool.FindServiceByName("kvcache.v1.CacheService")

def call(method_name, body):
    method = service.methods_by_name[method_name]
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)
    rpc = channel.unary_unary(f"/{service.full_name}/{method.name}",
                              request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)
    return json_format.MessageToDict(rpc(json_format.ParseDict(body, req_cls()), timeout=20))

layer = {"name": "l0", "kind": "LAYER_KIND_FULL_ATTENTION", "blockSize": "16",
         "numKvHeads": "1", "headSize": "8"}
registered = call("RegisterPool", {"poolId": "reflected", "layers": [layer],
                                   "numBlocks": "32", "options": {"maxModelLen": "128"}})
stepped = call("Step", {"poolId": "reflected", "beginStep": True, "ops": [
    {"addRequest": {"requestId": "r", "tokenIds": [str(i) for i in range(20)]}},
    {"allocate": {"requestId": "r", "numNewTokens": "20"}}]})
stats = call("GetPoolStats", {"poolId": "reflected"})
print(json.dumps({"services": services, "methods": [m.name for m in service.methods],
                  "registered": registered, "stepped": stepped, "stats": stats}))
'''


def test_a_reflection_only_client_discovers_and_calls_the_service(server: ServerProcess) -> None:
    proc = subprocess.run([sys.executable, "-c", DYNAMIC_CLIENT, server.target],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"kvcache.v1.CacheService", "grpc.health.v1.Health"} <= set(out["services"])
    assert {"RegisterPool", "Step", "StepStream", "SubscribeEvents",
            "PeekPrefix"} <= set(out["methods"])
    assert out["registered"]["config"]["numBlocks"] == "32"
    alloc = out["stepped"]["results"][1]["allocate"]
    assert alloc["ok"] is True and alloc["numComputedTokens"] == "20"
    assert len(alloc["blockIds"][0]["blockIds"]) == 2  # ceil(20 / 16)
    assert out["stats"]["stats"]["numFreeBlocks"] == str(32 - 1 - 2)
