"""Tenants: who a bearer token speaks for, and what that tenant may hold.

A tenant owns the pools it registers; it sees nothing of other tenants' pools (they answer
NOT_FOUND, as if they did not exist). An *admin* tenant (for operators) sees every pool.

Three modes, chosen by the server's settings:

* no auth: every caller is the one tenant ``default``;
* ``--auth-token T``: callers presenting ``T`` are the one tenant ``default``;
* ``--auth-tokens-file F``: one line per token, ``<token> <tenant> [options]``; options
  are ``admin``, ``max_pools=N``, ``max_blocks=N`` and ``max_pinned_blocks=N``
  (per-tenant limits over the server-wide defaults); ``#`` starts a comment. Several
  tokens may name one tenant (key rotation); their options must agree.

No gRPC here: :meth:`TenantTable.authenticate` takes the ``authorization`` metadata value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Tenant:
    """One tenant. ``max_pools`` / ``max_blocks`` (sum of its pools' num_blocks) /
    ``max_pinned_blocks`` (pinned blocks charged to pins over its pools) are None for no
    per-tenant limit (the server's block budget and each pool's pin bounds still apply)."""

    name: str
    admin: bool = False
    max_pools: int | None = None
    max_blocks: int | None = None
    max_pinned_blocks: int | None = None


#: The only tenant when auth is off or a single token is configured.
ANONYMOUS = Tenant("default")


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message names file and line."""


def _digest(token: str) -> bytes:
    # Tokens are looked up by their digest: a dict probe on a hash of the presented token
    # reveals nothing about stored tokens through timing.
    return hashlib.sha256(token.encode()).digest()


class TenantTable:
    """Bearer tokens -> tenants."""

    def __init__(self, tokens: dict[str, Tenant]) -> None:
        self._by_digest = {_digest(t): tenant for t, tenant in tokens.items()}
        self.tenants = {t.name: t for t in tokens.values()}

    @classmethod
    def single(cls, token: str, *, max_pools: int | None = None,
               max_blocks: int | None = None,
               max_pinned_blocks: int | None = None) -> TenantTable:
        """Today's single shared token: one tenant, ``default``."""
        return cls({token: dataclasses.replace(ANONYMOUS, max_pools=max_pools,
                                               max_blocks=max_blocks,
                                               max_pinned_blocks=max_pinned_blocks)})

    @classmethod
    def from_file(cls, path: Path, *, max_pools: int | None = None,
                  max_blocks: int | None = None,
                  max_pinned_blocks: int | None = None) -> TenantTable:
        """Parses a tenants file (format in the module doc); ``max_pools`` /
        ``max_blocks`` / ``max_pinned_blocks`` are the defaults of tenants whose line does
        not set them."""
        tokens: dict[str, Tenant] = {}
        try:
            text = path.read_text()
        except OSError as exc:
            raise TenantsFileError(f"{path}: {exc.strerror}") from None
        for number, raw in enumerate(text.splitlines(), 1):
            words = raw.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{path}:{number}"
            if len(words) < 2:
                raise TenantsFileError(f"{where}: expected '<token> <tenant> [options]'")
            token, name, *options = words
            if not TENANT_RE.fullmatch(name):
                raise TenantsFileError(f"{where}: tenant name must be 1-64 characters from "
                                       f"[A-Za-z0-9._-], got {name!r}")
            tenant = _parse_options(Tenant(name, max_pools=max_pools, max_blocks=max_blocks,
                                           max_pinned_blocks=max_pinned_blocks),
                                    options, where)
            if token in tokens:
                raise TenantsFileError(f"{where}: token repeated (first for tenant "
                                       f"{tokens[token].name!r})")
            same = next((t for t in tokens.values() if t.name == name), None)
            if same is not None and same != tenant:
                raise TenantsFileError(f"{where}: options of tenant {name!r} differ from "
                                       "an earlier line")
            tokens[token] = tenant
        if not tokens:
            raise TenantsFileError(f"{path}: no tokens")
        return cls(tokens)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``authorization: Bearer <token>`` value, or None."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self._by_digest.get(_digest(authorization[7:]))


#: The tenants-file options that set a per-tenant limit (Tenant fields of the same name).
_LIMITS = ("max_pools", "max_blocks", "max_pinned_blocks")


def _parse_options(tenant: Tenant, options: list[str], where: str) -> Tenant:
    for option in options:
        key, eq, value = option.partition("=")
        if key == "admin" and not eq:
            tenant = dataclasses.replace(tenant, admin=True)
        elif key in _LIMITS and eq:
            if not value.isdigit():
                raise TenantsFileError(f"{where}: {key} must be a non-negative integer, "
                                       f"got {value!r}")
            if key == "max_pools":
                tenant = dataclasses.replace(tenant, max_pools=int(value))
            elif key == "max_blocks":
                tenant = dataclasses.replace(tenant, max_blocks=int(value))
            else:
                tenant = dataclasses.replace(tenant, max_pinned_blocks=int(value))
        else:
            raise TenantsFileError(f"{where}: unknown option {option!r} (admin, "
                                   "max_pools=N, max_blocks=N, max_pinned_blocks=N)")
    return tenant


class Namespace:
    """The pool ids one tenant sees, mapped to the server's internal ids.

    Tenants have separate pool-id namespaces: tenant ``a``'s pool ``p`` is ``a/p`` inside
    the server ('/' is not allowed in pool ids, so internal ids never collide). The
    ``default`` tenant (the single-tenant modes) uses ids unchanged, so those deployments
    see no difference. An admin tenant sees the internal ids themselves: every pool, other
    tenants' as ``tenant/pool``.
    """

    __slots__ = ("tenant", "prefix")

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.prefix = "" if tenant.admin or tenant.name == ANONYMOUS.name else tenant.name + "/"

    def inner(self, pool_id: str) -> str | None:
        """The internal id of a pool id this tenant sent; None if it can name no pool of
        this tenant (a qualified id from a non-admin: answered like an unknown pool)."""
        if "/" in pool_id and not self.tenant.admin:
            return None
        return self.prefix + pool_id

    def outer(self, internal: str) -> str:
        """The id this tenant knows an internal id by."""
        if self.prefix and internal.startswith(self.prefix):
            return internal[len(self.prefix):]
        return internal

    def sees(self, internal: str) -> bool:
        """Whether this tenant may see the pool with this internal id."""
        if self.tenant.admin:
            return True
        return internal.startswith(self.prefix) if self.prefix else "/" not in internal

    def scrub(self, text: str) -> str:
        """An error message with internal ids shown as this tenant knows them."""
        return text.replace(f"'{self.prefix}", "'") if self.prefix else text


def tenant_of(internal: str) -> str:
    """The tenant owning the pool with this internal id."""
    head, sep, _ = internal.partition("/")
    return head if sep else ANONYMOUS.name
