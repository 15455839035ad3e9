"""A /metrics page read the way Prometheus reads it (``prometheus_client``'s own parser),
for tests that check a counter or a gauge: no hand parsing of the text format."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, timeout: float = 10) -> str:
    """The text of ``http://127.0.0.1:<port>/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def values(text: str, name: str, **labels: str) -> list[float]:
    """The values of every sample called ``name`` (``_total`` included for a counter)
    whose labels include ``labels``, in page order."""
    return [s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()]


def value(text: str, name: str, *, default: float | None = None, **labels: str) -> float:
    """The one sample ``name`` with ``labels`` (see :func:`values`); ``default`` when there
    is none (None: the sample must be there)."""
    found = values(text, name, **labels)
    if not found:
        assert default is not None, f"{name} {labels} not in /metrics"
        return default
    assert len(found) == 1, f"{len(found)} samples {name} {labels}: name more labels"
    return found[0]
