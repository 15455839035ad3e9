"""Server settings: command-line flags over ``KVCACHE_*`` environment variables over defaults.

One pydantic-settings model holds every knob; :func:`parse_settings` reads flags with
pydantic-settings' own CLI source (:mod:`kvcache_common.cli`), so ``--help`` lists each flag
with its environment variable and default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypedDict

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cache_service.registry import DEFAULT_MAX_TOTAL_BLOCKS
from cache_service.tenants import ANONYMOUS, Tenant, TenantTable
from kvcache_common.cli import parse_cli


class Settings(BaseSettings):
    """Every setting of ``kvcache-server``; each field ``x`` reads ``KVCACHE_X``."""

    model_config = SettingsConfigDict(env_prefix="KVCACHE_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (the docker image "
                      "sets 0.0.0.0)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 = an ephemeral port "
                      "(reported in the 'serving' log line)")
    metrics_port: int = Field(9400, ge=-1, le=65535, description="Prometheus /metrics HTTP "
                              "port on the same host; 0 = an ephemeral port (reported in the "
                              "'serving' line), -1 = disabled")
    drain_seconds: float = Field(5.0, ge=0, description="on SIGTERM/SIGINT: grace period "
                                 "for in-flight calls before they are cancelled")
    auth_token: SecretStr | None = Field(None, description="if set, every kvcache.v1 call "
                                         "needs 'authorization: Bearer <token>' (health and "
                                         "reflection stay open); prefer the environment "
                                         "variable: flags are visible in ps")
    auth_tokens_file: Path | None = Field(None, description="tenants: a file of "
                                          "'<token> <tenant> [admin] [max_pools=N] "
                                          "[max_blocks=N] [max_pinned_blocks=N]' lines; "
                                          "every kvcache.v1 call needs one of its tokens "
                                          "and sees only its tenant's pools (excludes "
                                          "--auth-token)")
    tenant_max_pools: int = Field(0, ge=0, description="pools one tenant may hold at once "
                                  "(0 = no limit); a tenants-file line may override it")
    tenant_max_blocks: int = Field(0, ge=0, description="sum of num_blocks (plus "
                                   "host-tier slots) over one tenant's pools (0 = no limit "
                                   "beyond "
                                   "--max-total-blocks); a tenants-file line may override it")
    tenant_max_pinned_blocks: int = Field(0, ge=0, description="pinned blocks (PinPrefix) "
                                          "charged over one tenant's pools (0 = no limit "
                                          "beyond each pool's max_pinned_blocks); a "
                                          "tenants-file line may override it")
    tls_cert: Path | None = Field(None, description="PEM certificate chain; with --tls-key "
                                  "the server speaks TLS")
    tls_key: Path | None = Field(None, description="PEM private key for --tls-cert")
    event_buffer: int = Field(10000, ge=1, description="KV events kept per pool for "
                              "SubscribeEvents resume; older sequences get OUT_OF_RANGE")
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="largest gRPC "
                                   "message accepted or sent")
    max_ops_per_step: int = Field(65536, ge=1, description="most ops in one Step (each "
                                  "request of a decode or fill_placeholders op counts as "
                                  "one)")
    max_tokens_per_step: int = Field(1 << 20, ge=1, description="most token ids in one Step "
                                     "(summed over its ops)")
    max_peek_tokens: int = Field(1 << 22, ge=1, description="most token ids (or block "
                                 "hashes) times hash recipes (times pools with explain) in "
                                 "one PeekPrefix")
    max_total_blocks: int = Field(DEFAULT_MAX_TOTAL_BLOCKS, ge=2, description="the server's "
                                  "block budget: the sum of num_blocks (plus host-tier "
                                  "slots: options.host_tier_blocks per group) over all pools; a "
                                  "RegisterPool beyond it is RESOURCE_EXHAUSTED (the allocator "
                                  "keeps ~100 bytes per block ever handed out)")
    lease_ttl_seconds: float = Field(30.0, gt=0, description="session lease: a session "
                                     "with no call (nor KeepAlive) for this long expires "
                                     "and its requests are freed")
    max_pin_ttl_seconds: float = Field(24 * 3600.0, gt=0, description="longest TTL a "
                                       "PinPrefix / RenewPin may ask for")
    keepalive_time_ms: int = Field(30000, ge=1000, description="server keepalive ping "
                                   "interval")
    keepalive_timeout_ms: int = Field(10000, ge=100, description="keepalive ping ack timeout")
    min_ping_interval_ms: int = Field(5000, ge=0, description="smallest client ping interval "
                                      "tolerated without data (faster pings get GOAWAY)")
    max_concurrent_streams: int = Field(256, ge=1, description="HTTP/2 streams per connection")
    etcd_endpoints: str | None = Field(None, description="cluster mode: comma-separated "
                                       "etcd client endpoints (host:port[,host:port]); the "
                                       "replica joins the cluster named --cluster-name")
    cluster_name: str = Field("default", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                              description="cluster mode: etcd keys live under "
                              "/kvcache/<cluster-name>/")
    member_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,128}$",
                                  description="cluster mode: this replica's stable name "
                                  "(default: its advertised address)")
    advertise_address: str | None = Field(None, description="cluster mode: host:port other "
                                          "replicas and clients reach this replica at "
                                          "(default: --host:<bound port>, the host name if "
                                          "--host is 0.0.0.0)")
    etcd_lease_ttl: int = Field(5, ge=2, le=300, description="cluster mode: seconds the etcd "
                           "lease outlives this replica's last keep-alive; the failover "
                           "detection time")
    replication: Literal["sync", "async", "none"] = Field(
        "sync", description="cluster mode: each pool's owner streams every accepted record "
        "to a standby replica (the next one in the pool's rendezvous order), which takes "
        "the pool over with its state when the owner dies. sync = a call is answered once "
        "the standby has its record (nothing answered is lost by one failure); async = "
        "answered before (a failover loses what the standby had not received); none = no "
        "standby (a failover without --shared-data-root starts the pool anew)")
    replication_timeout_seconds: float = Field(
        0.0, ge=0, description="cluster mode, --replication sync: how long a write waits "
        "for a standby that is unreachable or catching up before it is answered without "
        "it (degraded: kvcache_replication_degraded is 1); 0 = 3 x --etcd-lease-ttl")
    data_dir: Path | None = Field(None, description="directory for the write-ahead log and "
                                  "snapshots: every accepted mutation is logged before it "
                                  "is answered and a restart restores the state; unset = "
                                  "in-memory (a restart loses every pool)")
    shared_data_root: Path | None = Field(
        None, description="cluster mode: a directory every replica mounts (a shared "
        "volume); this replica's data directory is <root>/<member-id> (needs --member-id; "
        "--data-dir unset or that directory), and a replica taking a dead one's pools over "
        "restores them from that one's directory, read-only: same incarnation, no "
        "acknowledged Step lost")
    fsync: Literal["always", "batch", "never"] = Field(
        "batch", description="with --data-dir: when the log is flushed to disk. always = "
        "before each answer (nothing answered is lost, even on power loss); batch = every "
        "--fsync-interval-ms (an OS crash loses at most that window); never = when the OS "
        "decides. A killed process loses nothing answered in any mode")
    fsync_interval_ms: int = Field(50, ge=1, le=10000, description="with --fsync batch: "
                                   "the longest time a written record waits for fdatasync")
    snapshot_every: int = Field(5000, ge=1, description="with --data-dir: a background "
                                "snapshot after this many logged mutations (bounds the log "
                                "replayed at restart)")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="log level; 'debug' logs every call")

    # Pydantic runs these in definition order; the first rule broken is the one reported.
    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        return self

    @model_validator(mode="after")
    def _one_auth_mode(self) -> Settings:
        if self.auth_token is not None and self.auth_tokens_file is not None:
            raise ValueError("--auth-token and --auth-tokens-file exclude each other")
        return self

    @model_validator(mode="after")
    def _shared_data_root_rules(self) -> Settings:
        if self.shared_data_root is not None:
            if not (self.etcd_endpoints and self.member_id):
                raise ValueError("--shared-data-root needs --etcd-endpoints and --member-id")
            own = self.shared_data_root / self.member_id
            if self.data_dir is not None and self.data_dir != own:
                raise ValueError(f"with --shared-data-root, --data-dir must be {own} "
                                 "(<root>/<member-id>, where the others look) or unset")
        if self.replication_timeout_seconds and \
                self.replication_timeout_seconds <= 2 * self.etcd_lease_ttl:
            raise ValueError("--replication-timeout-seconds must exceed 2 x --etcd-lease-ttl "
                             "(with async a standby trusts its copy for the timeout less one "
                             "TTL after its stream broke)")
        return self

    @property
    def replication_wait(self) -> float:
        """--replication-timeout-seconds, its default resolved."""
        return self.replication_timeout_seconds or 3.0 * self.etcd_lease_ttl

    @property
    def state_dir(self) -> Path | None:
        """This replica's data directory: --data-dir, or <--shared-data-root>/<member-id>."""
        if self.shared_data_root is not None and self.member_id:
            return self.shared_data_root / self.member_id
        return self.data_dir

    def tenant_table(self) -> TenantTable | None:
        """The tenants of the configured auth mode (None: auth off, every caller is
        :meth:`unauthenticated_tenant`). Raises TenantsFileError for a bad file."""
        limits = self._tenant_limits()
        if self.auth_tokens_file is not None:
            return TenantTable.from_file(self.auth_tokens_file, **limits)
        if self.auth_token is not None:
            return TenantTable.single(self.auth_token.get_secret_value(), **limits)
        return None

    def unauthenticated_tenant(self) -> Tenant:
        """Every caller's tenant when auth is off."""
        return dataclasses.replace(ANONYMOUS, **self._tenant_limits())

    def _tenant_limits(self) -> _TenantLimits:
        return _TenantLimits(max_pools=self.tenant_max_pools or None,
                             max_blocks=self.tenant_max_blocks or None,
                             max_pinned_blocks=self.tenant_max_pinned_blocks or None)


class _TenantLimits(TypedDict):
    max_pools: int | None
    max_blocks: int | None
    max_pinned_blocks: int | None


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """Settings from ``argv`` (flags) and the environment; a bad value exits with a usage
    error naming the flag."""
    return parse_cli(Settings, argv, prog="kvcache-server", description=(
        "The KV-cache management service (gRPC kvcache.v1.CacheService, grpc.health.v1, "
        "reflection, Prometheus metrics). Every flag can also be set with the environment "
        "variable shown; flags win."))
