"""The worked example of docs/protocol.md ("Worked example") is run exactly as written.

Every fenced ```json block of that section is one call: ``{"call": RPC name, "request":
message, "answer": expected}``. The request goes to a real server as the proto-JSON message
(a string "a..b" in a list of token ids stands for a, a+1, ..., b); the answer must contain
every field the doc shows (fields the doc leaves out are not compared; a field the server
omits reads as its default: 0, false, empty).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
SECTION = "## Worked example"


def example_calls(text: str) -> list[dict[str, Any]]:
    section = text[text.index(SECTION):]
    end = section.find("\n## ", len(SECTION))
    section = section if end < 0 else section[:end]
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]


def expand(value: Any) -> Any:
    """Token-id lists may hold "a..b" ranges."""
    if isinstance(value, dict):
        return {k: expand(v) for k, v in value.items()}
    if isinstance(value, list):
        out: list[Any] = []
        for v in value:
            m = re.fullmatch(r"(\d+)\.\.(\d+)", v) if isinstance(v, str) else None
            out.extend(range(int(m[1]), int(m[2]) + 1) if m else [expand(v)])
        return out
    return value


def contains(actual: Any, expected: Any, path: str = "") -> list[str]:
    """Where ``actual`` (proto JSON of the answer) differs from what the doc shows."""
    if isinstance(expected, dict):
        actual = actual if isinstance(actual, dict) else {}
        return [d for k, v in expected.items() for d in contains(actual.get(k), v, f"{path}.{k}")]
    if isinstance(expected, list):
        actual = actual or []
        if len(actual) != len(expected):
            return [f"{path}: {actual} != {expected}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected))
                for d in contains(a, e, f"{path}[{i}]")]
    if actual is None:
        actual = type(expected)()  # omitted by the server = the default value
    if isinstance(expected, int) and not isinstance(expected, bool) and isinstance(actual, str):
        actual = int(actual)  # proto JSON writes int64 as a string
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def test_the_doc_has_the_example() -> None:
    calls = example_calls(DOC.read_text())
    assert len(calls) >= 8
    assert {c["call"] for c in calls} >= {"RegisterPool", "Step", "PeekPrefix"}


def test_worked_example_runs_as_written(stub) -> None:
    for i, call in enumerate(example_calls(DOC.read_text())):
        method = getattr(stub, call["call"])
        request_type = getattr(pb, call["call"] + "Request")
        request = json_format.ParseDict(expand(call["request"]), request_type())
        answer = json_format.MessageToDict(method(request, timeout=20),
                                           preserving_proto_field_name=True)
        diffs = contains(answer, call["answer"])
        assert not diffs, f"call {i} ({call['call']}): {diffs}\nanswer: {answer}"
