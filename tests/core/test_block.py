"""KVCacheBlock: hash bookkeeping."""

from __future__ import annotations

import pytest

from cache_service.core.block import KVCacheBlock


def test_set_and_reset_hash() -> None:
    b = KVCacheBlock(7)
    assert (b.block_id, b.ref_cnt, b.block_hash, b.is_null) == (7, 0, None, False)
    b.set_block_hash(b"h", 2)
    assert (b.block_hash, b.group_id) == (b"h", 2)
    with pytest.raises(AssertionError):
        b.set_block_hash(b"other", 0)
    b.reset_hash()
    assert b.block_hash is None


def test_slots_reject_new_attributes() -> None:
    with pytest.raises(AttributeError):
        KVCacheBlock(0).__setattr__("extra", 1)
