"""Recorded MCP sessions: a recorder that wraps a client, and a replayer that re-runs the requests.

A session file is JSON lines. The first line is a header::

    {"type": "header", "format": "traindx-session/1", "protocol_version": "...", "server_version": "...",
     "client": "...", "job": {"name": "lr_spike_job", "run": "...", "kwargs": {...}}}

and every other line one tool call with its response::

    {"type": "call", "seq": 3, "tool": "get_anomalies", "arguments": {...}, "is_error": false,
     "structured": {...}, "text": "..."}

Replaying compares each response with the recorded one after masking what legitimately changes from
one run to the next (the masking rule, also in the README):

- identifiers such as ``a-3`` and ``f-7`` become ``<id>``; the replayer learns the mapping from the
  recorded id to the replayed one and rewrites later requests with it;
- numbers become ``<number>`` (steps, losses, norms and timestamps depend on timing and hardware);
- free text (``message``, ``rationale``, ``reason``, ``summary``, ``report``, ...) becomes ``<text>``;
- everything else must match: keys, types, list lengths, and the meaning-bearing strings (kinds,
  severities, statuses, actions, error codes, tensor names).

Every tool of the server is idempotent, so a request whose masked response does not match yet (the
run has not reached that point) is sent again until it matches or its time runs out; then the
difference is reported with its path.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

FORMAT = "traindx-session/1"
ID = re.compile(r"^[af]-\d+$")
TEXT_KEYS = {"message", "rationale", "reason", "summary", "report", "explanation", "expected_effect", "text",
             "instructions", "notes"}
# Values that are neither numbers nor ids and still change between runs of the same seed.
VOLATILE_KEYS = {"data_dir", "host", "version", "requested_by", "actor"}


class SessionError(Exception):
    pass


def mask(value: Any, key: str | None = None) -> Any:
    """The masked form of a response, as documented above."""
    if key in TEXT_KEYS and value is not None:
        return "<text>"
    if key in VOLATILE_KEYS:
        return "<volatile>"
    if isinstance(value, dict):
        return {k: mask(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [mask(v, key) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return "<number>"
    if isinstance(value, str) and ID.match(value):
        return "<id>"
    return value


def diff(recorded: Any, replayed: Any, path: str = "$") -> list[str]:
    """Differences between two masked values, each with its JSON path."""
    if type(recorded) is not type(replayed):
        return [f"{path}: {type(recorded).__name__} {recorded!r:.60} != {type(replayed).__name__} {replayed!r:.60}"]
    if isinstance(recorded, dict):
        out = [f"{path}.{k}: missing in the replay" for k in recorded if k not in replayed]
        out += [f"{path}.{k}: not in the recording" for k in replayed if k not in recorded]
        for k in recorded:
            if k in replayed:
                out += diff(recorded[k], replayed[k], f"{path}.{k}")
        return out
    if isinstance(recorded, list):
        if len(recorded) != len(replayed):
            return [f"{path}: {len(recorded)} items recorded, {len(replayed)} replayed"]
        return [d for i, (a, b) in enumerate(zip(recorded, replayed)) for d in diff(a, b, f"{path}[{i}]")]
    return [] if recorded == replayed else [f"{path}: {recorded!r:.80} != {replayed!r:.80}"]


def _ids(value: Any, path: str = "$") -> dict[str, str]:
    """Every id in a response, by JSON path."""
    if isinstance(value, dict):
        return {p: v for k, item in value.items() for p, v in _ids(item, f"{path}.{k}").items()}
    if isinstance(value, list):
        return {p: v for i, item in enumerate(value) for p, v in _ids(item, f"{path}[{i}]").items()}
    return {path: value} if isinstance(value, str) and ID.match(value) else {}


def _rewrite(arguments: dict, ids: dict[str, str]) -> dict:
    return {k: ids.get(v, v) if isinstance(v, str) else v for k, v in arguments.items()}


class Recorder:
    """Wraps an MCP client: same ``call_tool``, and every call is written to the session file."""

    def __init__(self, client: Any, path: str | Path, *, job: dict | None = None) -> None:
        self.client = client
        self.path = Path(path)
        self.job = job
        self._seq = 0
        self._fh = None

    async def __aenter__(self) -> Recorder:
        info = self.client.server_info
        self._fh = open(self.path, "wb")
        self._write({"type": "header", "format": FORMAT, "protocol_version": self.client.protocol_version,
                     "server_version": info.version if info else None, "server_name": info.name if info else None,
                     "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "job": self.job})
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._fh.close()

    def _write(self, obj: dict) -> None:
        self._fh.write(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n")
        self._fh.flush()

    async def call_tool(self, name: str, arguments: dict | None = None) -> Any:
        result = await self.client.call_tool(name, arguments or {})
        self._seq += 1
        self._write({"type": "call", "seq": self._seq, "tool": name, "arguments": arguments or {},
                     "is_error": result.is_error, "structured": result.structured_content,
                     "text": " ".join(getattr(c, "text", "") for c in result.content)})
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def load(path: str | Path) -> tuple[dict, list[dict]]:
    """Read and check a session file; raise SessionError naming the line that is wrong."""
    header, calls = None, []
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise SessionError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise SessionError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(obj, dict) or obj.get("type") not in ("header", "call"):
            raise SessionError(f"{path}:{n}: expected an object with type 'header' or 'call'")
        if obj["type"] == "header":
            if header is not None or n != 1:
                raise SessionError(f"{path}:{n}: the header must be the first line, once")
            if obj.get("format") != FORMAT:
                raise SessionError(f"{path}:{n}: format {obj.get('format')!r} is not {FORMAT!r}")
            header = obj
        else:
            if not isinstance(obj.get("tool"), str) or not isinstance(obj.get("arguments"), dict):
                raise SessionError(f"{path}:{n}: a call needs a 'tool' name and an 'arguments' object")
            calls.append(obj)
    if header is None:
        raise SessionError(f"{path}: no header line")
    return header, calls


@dataclass
class Mismatch:
    seq: int
    tool: str
    differences: list[str]


@dataclass
class Report:
    calls: int = 0
    sent: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _groups(calls: list[dict]) -> list[list[dict]]:
    """Consecutive calls with the same tool and arguments are one poll: replay waits for its last answer."""
    groups: list[list[dict]] = []
    for c in calls:
        if groups and groups[-1][-1]["tool"] == c["tool"] and groups[-1][-1]["arguments"] == c["arguments"]:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


async def replay(client: Any, calls: list[dict], *, timeout: float = 60.0, poll: float = 0.2) -> Report:
    report = Report(calls=len(calls))
    ids: dict[str, str] = {}
    for group in _groups(calls):
        want = group[-1]
        expected = mask({"is_error": want["is_error"], "structured": want.get("structured")})
        arguments = _rewrite(want["arguments"], ids)
        deadline = time.monotonic() + timeout
        while True:
            result = await client.call_tool(want["tool"], arguments)
            report.sent += 1
            got = {"is_error": result.is_error, "structured": result.structured_content}
            differences = diff(expected, mask(got))
            if not differences or time.monotonic() > deadline:
                break
            await asyncio.sleep(poll)
        if differences:
            report.mismatches.append(Mismatch(want["seq"], want["tool"], differences))
            continue
        recorded_ids, replayed_ids = _ids(want.get("structured")), _ids(got["structured"])
        for p, rid in recorded_ids.items():
            if p in replayed_ids:
                ids[rid] = replayed_ids[p]
    return report


def start_job(spec: dict, server: str, **extra: Any) -> Any:
    """Start the session's seeded training job (a function of agent_examples.jobs) in a thread."""
    import threading

    from agent_examples import jobs

    fn = getattr(jobs, spec["name"], None)
    if fn is None or not callable(fn):
        raise SessionError(f"the session names job {spec['name']!r}, which agent_examples.jobs does not have")
    kwargs = dict(spec.get("kwargs") or {})
    kwargs.setdefault("probe_kwargs", {})
    kwargs["probe_kwargs"] = {**kwargs["probe_kwargs"], "server": server, **extra}
    thread = threading.Thread(target=fn, kwargs={"run": spec["run"], **kwargs}, daemon=True)
    thread.start()
    return thread
