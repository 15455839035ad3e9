"""Builders of protocol messages: layer specs (:class:`layers`), Step ops (:class:`ops`),
whole Step batches built in place (:class:`StepBuilder`), RegisterPool and PeekPrefix requests.

:class:`StepBuilder` is the one place that maps op arguments to message fields; ``ops.*``
builds a one-op batch with it and returns that op, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.specs_proto import layer_spec_to_proto
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.enums import HASH_ALGOS, MAMBA_CACHE_MODES


class layers:  # noqa: N801 - a namespace of builders, used as layers.full_attention(...)
    """Builders of ``LayerSpec`` messages for :meth:`AsyncCacheClient.register_pool`."""

    @staticmethod
    def full_attention(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
                       dtype: str = "bfloat16", head_size_v: int = 0) -> pb.LayerSpec:
        """A full-attention layer: every token's KV stays for the whole request.
        ``head_size_v`` (0: as ``head_size``) for MLA-style layers with a different value
        head size."""
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_FULL_ATTENTION,
                            block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype, head_size_v=head_size_v)

    @staticmethod
    def sliding_window(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
                       sliding_window: int, dtype: str = "bfloat16") -> pb.LayerSpec:
        """A sliding-window attention layer: only the last ``sliding_window`` tokens' blocks
        are needed, older ones are freed."""
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_SLIDING_WINDOW,
                            block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype, sliding_window=sliding_window)

    @staticmethod
    def chunked_local(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
                      attention_chunk_size: int, dtype: str = "bfloat16") -> pb.LayerSpec:
        """A chunked local attention layer: a token sees only its own chunk of
        ``attention_chunk_size`` tokens."""
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION,
                            block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype,
                            attention_chunk_size=attention_chunk_size)

    @staticmethod
    def mamba(name: str, *, block_size: int, shapes: Sequence[Sequence[int]],
              dtypes: Sequence[str], mamba_cache_mode: str = "none",
              mamba_type: str = "mamba2") -> pb.LayerSpec:
        """A Mamba layer: one state block per request (``shapes`` and ``dtypes`` one per state
        tensor); ``mamba_cache_mode`` "align" keeps prefix-cacheable checkpoints at block
        boundaries, "none" keeps none."""
        return pb.LayerSpec(
            name=name, kind=pb.LAYER_KIND_MAMBA, block_size=block_size,
            mamba_states=[pb.MambaState(shape=list(s), dtype=d) for s, d in zip(shapes, dtypes)],
            mamba_cache_mode=MAMBA_CACHE_MODES.value(mamba_cache_mode), mamba_type=mamba_type)

    @staticmethod
    def rswa(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
             rswa_window: int, dtype: str = "bfloat16") -> pb.LayerSpec:
        """A reference sliding-window (R-SWA) layer: the prompt stays attended, of the
        generated tokens only the last ``rswa_window``; the blocks between them are freed."""
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_RSWA, block_size=block_size,
                            num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                            rswa_window=rswa_window)

    @staticmethod
    def circular_buffer(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
                        dtype: str = "bfloat16") -> pb.LayerSpec:
        """A ring buffer of ``block_size`` rows: one block per request for its whole life,
        never prefix cached."""
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_CIRCULAR_BUFFER,
                            block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype)

    #: The ``LayerSpec`` of a core layer spec (see :mod:`cache_service.specs_proto`).
    from_spec = staticmethod(layer_spec_to_proto)


class StepBuilder:
    """Builds one StepRequest in place — about 4x cheaper than a list of ``ops.*``
    messages, which matters for a 256-request decode step. Send it with
    ``client.step_batch(builder)``. Methods mirror :class:`ops` and return the builder::

        batch = StepBuilder("llama", begin_step=True)
        for rid in running:  # decode: append the last token and allocate its slot
            batch.allocate(rid, 1, append_token_ids=[last_token[rid]])
        result = client.step_batch(batch)
    """

    __slots__ = ("request", "_add")

    def __init__(self, pool_id: str, *, begin_step: bool = False) -> None:
        self.request = pb.StepRequest(pool_id=pool_id, begin_step=begin_step)
        self._add = self.request.ops.add

    def __len__(self) -> int:
        return len(self.request.ops)

    def add(self, request_id: str, token_ids: Sequence[int], *,
            block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
            lora_name: str | None = None, lora_path: str | None = None,
            hash_recipe: pb.HashRecipe | None = None, eviction_class: int = 0,
            mm_items: Sequence[tuple[str, int, int]] = (),
            prompt_embeds_digests: Sequence[bytes] = (),
            lora_id: int | None = None) -> StepBuilder:
        """Appends an add op (a new request and its prompt; ``block_hashes`` when the client
        hashed it itself; ``eviction_class``: docs/semantics.md, "Eviction classes";
        ``mm_items`` ``(identifier, offset, length)`` and ``prompt_embeds_digests``:
        docs/hashing.md section 2; ``lora_id``: vLLM's LoRA int id, named by the events);
        returns the builder, for chaining."""
        m = self._add().add_request
        m.request_id = request_id
        m.token_ids.extend(token_ids)
        if block_hashes:
            m.block_hashes.extend(block_hashes)
        if cache_salt:
            m.cache_salt = cache_salt
        if lora_name:
            m.lora_name = lora_name
        if lora_path:
            m.lora_path = lora_path
        if hash_recipe is not None:
            m.hash_recipe.CopyFrom(hash_recipe)
        if eviction_class:
            m.eviction_class = eviction_class
        for identifier, offset, length in mm_items:
            m.mm_items.add(identifier=identifier, offset=offset, length=length)
        if prompt_embeds_digests:
            m.prompt_embeds_digests.extend(prompt_embeds_digests)
        if lora_id is not None:
            m.lora_id = lora_id
        return self

    def lookup(self, request_id: str, *, explain: bool = False) -> StepBuilder:
        """Appends a lookup op (the request's cached prefix; ``explain``: why each group's hit
        ends where it does)."""
        op = self._add().lookup
        op.request_id = request_id
        if explain:
            op.explain = True
        return self

    def allocate(self, request_id: str, num_new_tokens: int, *, num_lookahead_tokens: int = 0,
                 full_sequence_must_fit: bool = False, use_lookup: bool = True,
                 delay_cache_blocks: bool = False, block_table: bool = True,
                 append_token_ids: Sequence[int] = (),
                 num_placeholder_tokens: int = 0) -> StepBuilder:
        """Appends an allocate op: room for ``num_new_tokens`` more computed tokens (and
        ``num_lookahead_tokens`` speculative ones), using the lookup's hit unless
        ``use_lookup`` is False; ``block_table=False`` answers no table."""
        m = self._add().allocate
        m.request_id = request_id
        m.num_new_tokens = num_new_tokens
        if append_token_ids:
            m.append_token_ids.extend(append_token_ids)
        if num_placeholder_tokens:
            m.num_placeholder_tokens = num_placeholder_tokens
        if num_lookahead_tokens:
            m.num_lookahead_tokens = num_lookahead_tokens
        if full_sequence_must_fit:
            m.full_sequence_must_fit = True
        if not use_lookup:
            m.skip_lookup = True
        if delay_cache_blocks:
            m.delay_cache_blocks = True
        if not block_table:
            m.skip_block_table = True
        return self

    def append(self, request_id: str, token_ids: Sequence[int]) -> StepBuilder:
        """Appends an append op: decoded output tokens of the request (its block hashes grow;
        no block is allocated)."""
        m = self._add().append_tokens
        m.request_id = request_id
        m.token_ids.extend(token_ids)
        return self

    def free(self, request_id: str, *, evict_first: bool = False,
             tail_first_across_groups: bool = False) -> StepBuilder:
        """Appends a free op: the request ends, its blocks go back (cached ones stay
        reusable); ``evict_first``: they go to the front of the free queue (a release hint);
        ``tail_first_across_groups``: in the order of vLLM's deferred free."""
        m = self._add().free
        m.request_id = request_id
        if evict_first:
            m.evict_first = True
        if tail_first_across_groups:
            m.tail_first_across_groups = True
        return self

    def preempt(self, request_id: str) -> StepBuilder:
        """Appends a preempt op: the request's blocks are freed but the request stays (computed
        tokens back to 0), to be looked up and allocated again."""
        self._add().preempt.request_id = request_id
        return self

    def new_step(self) -> StepBuilder:
        """Appends a new-step op: a new scheduler step starts here (once a pool has seen one,
        steps are explicit; before that, every allocate starts one)."""
        self._add().new_step.SetInParent()
        return self

    def decode(self, request_ids: Sequence[str], token_ids: Sequence[int] = (), *,
               placeholders: bool = False) -> StepBuilder:
        """See :meth:`ops.decode`."""
        m = self._add().decode
        m.request_ids.extend(request_ids)
        m.token_ids.extend(token_ids)
        if placeholders:
            m.placeholders = True
        return self

    def fill(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> StepBuilder:
        """See :meth:`ops.fill`."""
        m = self._add().fill_placeholders
        m.request_ids.extend(request_ids)
        m.token_ids.extend(token_ids)
        return self

    def reset_host_tier(self) -> StepBuilder:
        """See :meth:`ops.reset_host_tier`."""
        self._add().reset_host_tier.SetInParent()
        return self


class ops:  # noqa: N801 - a namespace of builders, used as ops.allocate(...)
    """Builders of single Step operations (``kvcache.v1.Op``); arguments as the methods of
    :class:`StepBuilder`, which fills the fields."""

    @staticmethod
    def add(request_id: str, token_ids: Sequence[int], *,
            block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
            lora_name: str | None = None, lora_path: str | None = None,
            hash_recipe: pb.HashRecipe | None = None,
            mm_items: Sequence[tuple[str, int, int]] = (),
            prompt_embeds_digests: Sequence[bytes] = (),
            lora_id: int | None = None) -> pb.Op:
        """Register a request (its prompt tokens; optionally client-computed hashes, and
        the recipe they were computed with, checked against the pool's). A LoRA request
        hashes ``("lora", lora_name, lora_path)`` as vLLM does; multimodal items and
        prompt-embedding digests as docs/hashing.md section 2 says."""
        return _one().add(request_id, token_ids, block_hashes=block_hashes,
                          cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path,
                          hash_recipe=hash_recipe, mm_items=mm_items,
                          prompt_embeds_digests=prompt_embeds_digests,
                          lora_id=lora_id).request.ops[0]

    @staticmethod
    def lookup(request_id: str, *, explain: bool = False) -> pb.Op:
        """Find the request's prefix-cache hit (used by its next allocate); ``explain``
        adds every group's reach and miss reason."""
        return _one().lookup(request_id, explain=explain).request.ops[0]

    @staticmethod
    def allocate(request_id: str, num_new_tokens: int, *, num_lookahead_tokens: int = 0,
                 full_sequence_must_fit: bool = False, use_lookup: bool = True,
                 delay_cache_blocks: bool = False, block_table: bool = True,
                 append_token_ids: Sequence[int] = (),
                 num_placeholder_tokens: int = 0) -> pb.Op:
        """Allocate slots for ``num_new_tokens``; ``block_table=False`` omits the whole
        table from the result (only the new blocks come back); ``append_token_ids`` are
        appended first (a decode step in one op), then ``num_placeholder_tokens`` tokens
        whose ids come later (:meth:`fill`)."""
        return _one().allocate(
            request_id, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens,
            full_sequence_must_fit=full_sequence_must_fit, use_lookup=use_lookup,
            delay_cache_blocks=delay_cache_blocks, block_table=block_table,
            append_token_ids=append_token_ids,
            num_placeholder_tokens=num_placeholder_tokens).request.ops[0]

    @staticmethod
    def append(request_id: str, token_ids: Sequence[int]) -> pb.Op:
        """Append decoded output tokens."""
        return _one().append(request_id, token_ids).request.ops[0]

    @staticmethod
    def free(request_id: str, *, evict_first: bool = False,
             tail_first_across_groups: bool = False) -> pb.Op:
        """Free and forget a finished request (see :meth:`StepBuilder.free`)."""
        return _one().free(request_id, evict_first=evict_first,
                           tail_first_across_groups=tail_first_across_groups).request.ops[0]

    @staticmethod
    def preempt(request_id: str) -> pb.Op:
        """Free a request's blocks but keep it for re-admission."""
        return _one().preempt(request_id).request.ops[0]

    @staticmethod
    def new_step() -> pb.Op:
        """Begin a scheduler step."""
        return _one().new_step().request.ops[0]

    @staticmethod
    def decode(request_ids: Sequence[str], token_ids: Sequence[int] = (), *,
               placeholders: bool = False) -> pb.Op:
        """The decode step of many running requests: ``token_ids[i]`` is appended to
        ``request_ids[i]`` and one slot allocated (as ``allocate(rid, 1, block_table=False,
        append_token_ids=[token])`` each), in one compact op. Answered by a
        :class:`DecodeResult`. ``placeholders=True`` (no token ids): each request appends
        a placeholder instead, the token its running forward pass samples; its id follows
        in a later :meth:`fill`."""
        return _one().decode(request_ids, token_ids,
                             placeholders=placeholders).request.ops[0]

    @staticmethod
    def fill(request_ids: Sequence[str], token_ids: Sequence[int]) -> pb.Op:
        """``token_ids[i]`` becomes the id of the oldest unfilled placeholder of
        ``request_ids[i]`` (an id may repeat); blocks whose tokens are then all known are
        cached. Answered by a :class:`FillResult`."""
        return _one().fill(request_ids, token_ids).request.ops[0]

    @staticmethod
    def reset_host_tier() -> pb.Op:
        """The executor's host tier is empty (it restarted): the pool forgets every host
        slot (docs/protocol.md#host-tier). Answered by a :class:`ResetHostTierResult`."""
        return _one().reset_host_tier().request.ops[0]


def _one() -> StepBuilder:
    return StepBuilder("")


def register_request(pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                     num_blocks: int | None = None,
                     available_memory_bytes: int | None = None, max_model_len: int,
                     enable_caching: bool = True, hash_algo: str = "sha256",
                     watermark: float = 0.0, vocab_size: int | None = None,
                     scheduler_block_size: int | None = None,
                     hash_block_size: int | None = None,
                     max_in_flight_tokens: int | None = None, enable_events: bool = True,
                     hybrid: bool = True,
                     skip_capacity_check: bool = False,
                     session_block_quota: int = 0,
                     prefix_cache_retention_interval: int | None = None,
                     enable_mamba_shared_prefix_checkpoint: bool = False,
                     max_pinned_blocks: int | None = None,
                     session_pinned_block_quota: int = 0,
                     use_eagle: bool = False,
                     host_tier_blocks: int = 0,
                     num_hash_lookahead_tokens: int = 0,
                     **unexpected: object) -> pb.RegisterPoolRequest:
    """The RegisterPool message for the keyword arguments of ``register_pool`` (a mistyped
    one is a TypeError naming ``register_pool`` and the arguments it takes, not this
    function, which the caller never called)."""
    if unexpected:
        code = register_request.__code__
        known = code.co_varnames[2:code.co_argcount + code.co_kwonlyargcount]
        raise TypeError(f"register_pool() got an unexpected keyword argument "
                        f"{next(iter(unexpected))!r}; it takes: {', '.join(known)}")
    if (num_blocks is None) == (available_memory_bytes is None):
        raise ValueError("give exactly one of num_blocks and available_memory_bytes")
    options = pb.PoolOptions(
        max_model_len=max_model_len, enable_caching=enable_caching,
        hash_algo=HASH_ALGOS.value(hash_algo), watermark=watermark, vocab_size=vocab_size or 0,
        scheduler_block_size=scheduler_block_size or 0, hash_block_size=hash_block_size or 0,
        max_in_flight_tokens=max_in_flight_tokens or 0, enable_events=enable_events,
        hybrid=hybrid, skip_capacity_check=skip_capacity_check,
        session_block_quota=session_block_quota,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
        enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
        max_pinned_blocks=max_pinned_blocks,
        session_pinned_block_quota=session_pinned_block_quota,
        use_eagle=use_eagle, host_tier_blocks=host_tier_blocks,
        num_hash_lookahead_tokens=num_hash_lookahead_tokens)
    req = pb.RegisterPoolRequest(pool_id=pool_id, layers=layer_specs, options=options)
    if num_blocks is not None:
        req.num_blocks = num_blocks
    elif available_memory_bytes is not None:  # exactly one of the two (checked above)
        req.available_memory_bytes = available_memory_bytes
    return req


def peek_request(pool_ids: Sequence[str], token_ids: Sequence[int],
                  block_hashes: Sequence[bytes], cache_salt: str | None,
                  lora_name: str | None, lora_path: str | None,
                  explain: bool = False, mm_items: Sequence[tuple[str, int, int]] = (),
                  prompt_embeds_digests: Sequence[bytes] = ()) -> pb.PeekPrefixRequest:
    """The PeekPrefixRequest of :meth:`~AsyncCacheClient.peek_prefix` (None and "" are the
    same: not set)."""
    req = pb.PeekPrefixRequest(pool_ids=pool_ids, token_ids=token_ids,
                               block_hashes=block_hashes, cache_salt=cache_salt or "",
                               lora_name=lora_name or "", lora_path=lora_path or "",
                               explain=explain, prompt_embeds_digests=prompt_embeds_digests)
    for identifier, offset, length in mm_items:
        req.mm_items.add(identifier=identifier, offset=offset, length=length)
    return req


def decode_request(pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int],
                   begin_step: bool) -> pb.StepRequest:
    """A StepRequest of one decode op: one token for each of ``request_ids``."""
    return StepBuilder(pool_id, begin_step=begin_step).decode(request_ids, token_ids).request


def subscribe_request(pool_id: str, from_sequence: int | None,
                      incarnation: int | None) -> pb.SubscribeEventsRequest:
    """Live events only unless ``from_sequence`` is given; ``incarnation`` pins a resume to
    the pool incarnation the sequence numbers belong to."""
    req = pb.SubscribeEventsRequest(pool_id=pool_id)
    if from_sequence is not None:
        req.from_sequence = from_sequence
    if incarnation is not None:
        req.incarnation = incarnation
    return req
