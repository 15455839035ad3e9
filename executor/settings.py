"""Executor settings: flags over ``KVCACHE_EXECUTOR_*`` environment variables over defaults
(the same command-line mechanism as ``cache_service.settings``:
:func:`kvcache_common.cli.parse_cli`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from executor.presets import DEFAULT_PRESET, PRESETS
from kvcache_common.cli import parse_cli

if TYPE_CHECKING:
    # A Literal built at run time is no type to a static checker: to it a preset is a str.
    PresetName = str
else:
    #: The preset names as a Literal, so that --help lists them and a wrong one names the
    #: choices.
    PresetName = Literal[tuple(sorted(PRESETS))]


class ExecutorSettings(BaseSettings):
    """Every setting of ``kvcache-executor``; each field ``x`` reads ``KVCACHE_EXECUTOR_X``."""

    model_config = SettingsConfigDict(env_prefix="KVCACHE_EXECUTOR_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(50061, ge=0, le=65535, description="gRPC port; 0 = ephemeral (reported "
                      "in the 'listening' and 'serving' log lines)")
    metrics_port: int = Field(-1, ge=-1, le=65535, description="Prometheus /metrics port; "
                              "0 = ephemeral, -1 = disabled")
    cache_service: str = Field("127.0.0.1:50051", description="cache service address HOST:PORT")
    pool_id: str = Field("", description="pool id to register; empty = '<model>-<random>'")
    preset: PresetName = Field(DEFAULT_PRESET, description="model preset: a tiny random-weight "
                               "model (see executor.presets)")
    model_config_json: Path | None = Field(None, description="a ModelConfig JSON file "
                                           "(overrides --preset)")
    hf_checkpoint: Path | None = Field(None, description="a Hugging Face checkpoint directory "
                                       "(config.json + safetensors; overrides --preset)")
    seed: int | None = Field(None, description="random-weight seed (default: the preset's)")
    max_model_len: int = Field(0, ge=0, description="longest sequence (0 = the model's own; "
                               "a checkpoint's, at most 4096); the pool must fit one request "
                               "of this length")
    device: str = Field("cpu", description="torch device for the model and the cache ('cpu', "
                        "'cuda', 'cuda:1'); CUDA runs the kernels' Triton implementations")
    cache_memory_mb: float = Field(32.0, gt=0, description="KV-cache memory budget (MiB)")
    num_blocks: int = Field(0, ge=0, description="pool size in blocks incl. the null block "
                            "(0 = from --cache-memory-mb)")
    block_size: int = Field(16, ge=1, description="attention block size before Mamba unification")
    enable_prefix_caching: bool = Field(True, description="prefix caching in the pool")
    mamba_cache_mode: Literal["align", "none"] = Field(
        "align", description="Mamba prefix caching mode (align = checkpoints per block)")
    host_tier_blocks: int = Field(0, ge=0, le=16777216, description="host-memory tier: "
                                  "slots per KV-cache group for cached blocks the pool "
                                  "evicts (pinned memory on CUDA); 0 = none "
                                  "(docs/executor.md#host-tier)")
    host_tier_fail_promotion: int = Field(0, ge=0, description="fault injection (tests): "
                                          "the Nth host-tier promotion copy fails (its "
                                          "requests recompute); 0 = never")
    max_num_seqs: int = Field(64, ge=1, description="running requests at most")
    max_tokens_per_step: int = Field(256, ge=1, description="token budget of one forward pass")
    async_cache_step: bool = Field(True, description="send each step's cache call while the "
                                   "previous forward pass runs (decode slots as placeholder "
                                   "tokens, their ids one call later); off = one after the "
                                   "other, for debugging and comparison")
    drain_seconds: float = Field(10.0, ge=0, description="on SIGTERM: time for running "
                                 "requests to finish")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")


def parse_settings(argv: Sequence[str] | None = None) -> ExecutorSettings:
    """Settings from ``argv`` (flags) and the environment; a bad value exits with a usage
    error naming the flag (booleans are ``--x`` / ``--no-x``)."""
    return parse_cli(ExecutorSettings, argv, prog="kvcache-executor", description=(
        "Executor service (gRPC kvcache.v1.ExecutorService, health, reflection, metrics): runs "
        "a hybrid model on a paged cache managed by the cache service. Every flag can also be "
        "set with the environment variable shown; flags win."))
