"""The tenants file: tokens -> tenants with options, and its errors naming file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_service.tenants import ANONYMOUS, Tenant, TenantsFileError, TenantTable


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants"
    path.write_text(text)
    return path


def test_tokens_map_to_tenants_with_their_options(tmp_path: Path) -> None:
    table = TenantTable.from_file(write(tmp_path, """
        # token            tenant   options
        tok-a-1            team-a   max_pools=2
        tok-a-2            team-a   max_pools=2   # a second key of the same tenant
        tok-b              team-b   max_blocks=4096 max_pinned_blocks=64
        tok-ops            ops      admin
    """), max_pools=5)
    assert table.authenticate("Bearer tok-a-1") == Tenant("team-a", max_pools=2)
    assert table.authenticate("Bearer tok-a-2") == Tenant("team-a", max_pools=2)
    assert table.authenticate("Bearer tok-b") == Tenant("team-b", max_pools=5,
                                                        max_blocks=4096,
                                                        max_pinned_blocks=64)
    ops = table.authenticate("Bearer tok-ops")
    assert ops is not None and ops.admin
    for bad in (None, "", "tok-b", "Bearer tok-b ", "Bearer ", "bearer tok-b", "Bearer x"):
        assert table.authenticate(bad) is None
    assert sorted(table.tenants) == ["ops", "team-a", "team-b"]


def test_the_single_token_mode_is_one_default_tenant() -> None:
    table = TenantTable.single("s3cret", max_pools=3)
    assert table.authenticate("Bearer s3cret") == Tenant(ANONYMOUS.name, max_pools=3)
    assert table.authenticate("Bearer other") is None


@pytest.mark.parametrize(("text", "message"), [
    ("tok\n", ":1: expected '<token> <tenant> [options]'"),
    ("\n\ntok bad/name\n", ":3: tenant name"),
    ("tok a max_pools=-1\n", ":1: max_pools must be a non-negative integer"),
    ("tok a max_pinned_blocks=x\n", ":1: max_pinned_blocks must be a non-negative integer"),
    ("tok a root\n", ":1: unknown option 'root'"),
    ("tok a\ntok b\n", ":2: token repeated"),
    ("t1 a admin\nt2 a\n", ":2: options of tenant 'a' differ"),
    ("# nothing\n", "no tokens"),
])
def test_bad_files_are_refused_naming_the_line(tmp_path: Path, text: str,
                                               message: str) -> None:
    with pytest.raises(TenantsFileError) as err:
        TenantTable.from_file(write(tmp_path, text))
    assert message in str(err.value) and str(tmp_path) in str(err.value)
