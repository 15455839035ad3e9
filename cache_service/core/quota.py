"""Per-account block quotas inside one pool.

Every request of a pool with a quota belongs to an *account* (the service uses the client
session that added it; requests added without a session share the account ``""``). An
account's usage is the number of blocks its requests hold (null blocks excluded; a block
held by two of its requests counts twice). An allocation whose new blocks would take the
account beyond the quota answers "no room" for that request only, exactly like a full
pool; other accounts' allocations are unaffected.

Invariant: ``used[a] == sum(held[r] for r in requests of a)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_service.core.restore import RebuiltFromFields


@dataclass
class BlockQuota(RebuiltFromFields):
    """The quota ``limit`` (blocks per account) and the accounts' usage."""

    limit: int
    used: dict[str, int] = field(default_factory=dict)
    #: request id -> (account, blocks it holds)
    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: account -> number of its requests
    members: dict[str, int] = field(default_factory=dict)
    #: allocations answered "no room" because of the quota (not of the pool)
    refusals: int = 0

    def join(self, request_id: str, account: str) -> None:
        """A new request of ``account`` (holding nothing yet)."""
        self.held[request_id] = (account, 0)
        self.used.setdefault(account, 0)
        self.members[account] = self.members.get(account, 0) + 1

    def room(self, request_id: str) -> int:
        """How many more blocks the request's account may take."""
        account, _ = self.held[request_id]
        return self.limit - self.used[account]

    def update(self, request_id: str, holds: int) -> None:
        """The request now holds ``holds`` blocks."""
        account, before = self.held[request_id]
        self.held[request_id] = (account, holds)
        self.used[account] += holds - before

    def leave(self, request_id: str) -> None:
        """The request is gone (its blocks were freed)."""
        account, before = self.held.pop(request_id)
        self.members[account] -= 1
        if self.members[account]:
            self.used[account] -= before
        else:
            del self.members[account], self.used[account]

    @property
    def max_used(self) -> int:
        """The largest usage of any account (0 without accounts)."""
        return max(self.used.values(), default=0)
