"""The pieces of a hand-over that need no etcd: a sealed log takes no record, a hand-over
file is read back only when intact, and a replica's drop of a pool it lost is not read by
its successor as a deletion (real data directories on disk)."""

from __future__ import annotations

import pytest

from cache_service.client import ops
from cache_service.client._builders import register_request
from cache_service.cluster.handoff import HandoffError, read_handoff, write_handoff
from cache_service.errors import Unavailable
from cache_service.server import open_state, read_peer_state
from cache_service.settings import parse_settings
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from tests.cluster.conftest import small_layers


def _registered(tmp_path):
    settings = parse_settings(["--data-dir", str(tmp_path / "m0")])
    state, data_dir = open_state(settings)
    assert data_dir is not None
    state.apply_call("register_pool", register_request("p", small_layers(), num_blocks=64,
                                                       max_model_len=256))
    state.apply_call("step", pb.StepRequest(pool_id="p", ops=[ops.add("a", [1, 2, 3]),
                                                              ops.allocate("a", 3)]))
    return settings, state, data_dir


def test_a_sealed_log_refuses_every_write_and_changes_nothing(tmp_path):
    settings, state, data_dir = _registered(tmp_path)
    last, before = data_dir.wal.last_index, state.export_pool("p")
    data_dir.seal()
    with pytest.raises(Unavailable, match="sealed"):
        state.apply_call("step", pb.StepRequest(pool_id="p", ops=[ops.add("b", [4, 5])]))
    assert state.export_pool("p") == before  # nothing applied
    data_dir.close(state)
    assert data_dir.wal.last_index == last
    again, reopened = open_state(settings)  # the log ends at the seal
    assert reopened is not None and reopened.wal.last_index == last
    assert again.export_pool("p") == state.export_pool("p")
    reopened.close()


def test_a_hand_over_file_is_read_back_only_when_intact(tmp_path):
    payload = b"state" * 1000
    path = write_handoff(tmp_path, "tenant/p", 42, payload)
    assert path.parent.name == "handoff" and "/" not in path.name
    assert read_handoff(path) == payload
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(HandoffError, match="checksum"):
        read_handoff(path)
    path.write_bytes(data[:20])
    with pytest.raises(HandoffError, match="truncated"):
        read_handoff(path)
    with pytest.raises(HandoffError, match="cannot be read"):
        read_handoff(tmp_path / "missing.pool")


def test_a_drop_of_a_lost_pool_is_not_replayed_as_a_deletion_by_the_successor(tmp_path):
    settings, state, data_dir = _registered(tmp_path)
    before = state.export_pool("p")
    # The replica saw the pool owned elsewhere and dropped it (a logged DeletePool).
    state.apply_call("delete_pool", pb.DeletePoolRequest(pool_id="p"))
    data_dir.close()
    assert read_peer_state(settings, tmp_path / "m0", "p") == before
