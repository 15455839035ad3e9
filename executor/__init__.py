"""Executor service: hybrid models on a paged cache managed by the cache service."""
