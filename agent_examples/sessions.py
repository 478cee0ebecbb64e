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
  recorded id to the replayed one and rewrites later requests with it; a list of ids (the consequences
  of a cause) becomes ``<ids>``;
- numbers become ``<number>`` (steps, losses, norms and timestamps depend on timing and hardware);
- free text (``message``, ``rationale``, ``reason``, ``summary``, ``report``, ``context``, ``history``, ...)
  becomes ``<text>``, and so does a ``severity``: it escalates while a live fault goes on, so it depends
  on the moment of the call; for the same reason an anomaly's ``evidence`` keeps its keys but not its
  values, and the list of ``tensors`` it has reached becomes ``<tensors>``;
- a list of records (items with an ``id`` or an ``anomaly_id``: anomalies, fixes, causes) is matched
  item by item whatever the order: every recorded item must have a replayed item equal to it after
  masking. A live fault raises follow-on anomalies at moments that depend on timing, so the replay may
  hold more items than the recording, but only where the recording held some: a recorded empty list
  (a healthy run) must stay empty;
- an anomaly that measures the machine rather than the job (``step_time_outlier``: a stall from another
  process, or a garbage collection in the process that hosts the job) is dropped on both sides, from lists
  of records and from counts by kind: the same seeded job stalls or not depending on the machine;
- everything else must match: keys, types, the lengths of other lists, and the meaning-bearing strings
  (kinds, statuses, actions, error codes, tensor names).

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
             "instructions", "notes", "context", "history", "severity"}
# Values that are neither numbers nor ids and still change between runs of the same seed.
VOLATILE_KEYS = {"data_dir", "host", "version", "requested_by", "actor"}
# What a live anomaly has seen so far: it grows while the fault goes on.
EVOLVING_KEYS = {"evidence", "tensors"}
# Anomaly kinds about the machine that runs the job, not the job: a replay on a loaded machine may see one
# the recording did not (measured: a healthy replay in the suite met a stall long enough to flag).
MACHINE_KINDS = {"step_time_outlier"}


class SessionError(Exception):
    pass


def mask(value: Any) -> Any:
    """The masked form of a response, as documented above."""
    return _mask(_about_the_job(value))


def _about_the_job(value: Any, key: str | None = None) -> Any:
    """The response without what measures the machine (MACHINE_KINDS); everything else keeps its place."""
    if isinstance(value, dict):
        return {k: _about_the_job(v, k) for k, v in value.items()
                if key != "anomalies_by_kind" or k not in MACHINE_KINDS}
    if isinstance(value, list):
        return [_about_the_job(v) for v in value
                if not (_is_record(v) and v.get("kind") in MACHINE_KINDS)]
    return value


def _mask(value: Any, key: str | None = None) -> Any:
    if key in TEXT_KEYS and value is not None:
        return "<text>"
    if key in VOLATILE_KEYS:
        return "<volatile>"
    if key in EVOLVING_KEYS and value is not None:
        return {k: "<value>" for k in value} if isinstance(value, dict) else f"<{key}>"
    if isinstance(value, dict):
        return {k: _mask(v, k) for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(v, str) and ID.match(v) for v in value):
            return "<ids>"
        return [_mask(v, key) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return "<number>"
    if isinstance(value, str) and ID.match(value):
        return "<id>"
    return value


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and ("id" in value or "anomaly_id" in value)


def _label(item: dict) -> str:
    return next((f"{k}={item[k]!r}" for k in ("kind", "action", "tensor") if isinstance(item.get(k), str)), "")


def _compare(recorded: Any, replayed: Any, path: str, pairs: list[tuple[Any, Any]] | None = None,
             raw: tuple[Any, Any] = (None, None)) -> list[str]:
    """Differences between two masked values.

    ``raw`` holds the same two values unmasked (masking keeps keys and list positions); ``pairs`` collects
    the raw (recorded, replayed) records that were matched, which is where the replay learns its ids.
    """
    pairs = [] if pairs is None else pairs
    if type(recorded) is not type(replayed):
        return [f"{path}: {type(recorded).__name__} {recorded!r:.60} != {type(replayed).__name__} {replayed!r:.60}"]
    if isinstance(recorded, dict):
        out = [f"{path}.{k}: missing in the replay" for k in recorded if k not in replayed]
        out += [f"{path}.{k}: not in the recording" for k in replayed if k not in recorded]
        for k in recorded:
            if k in replayed:
                out += _compare(recorded[k], replayed[k], f"{path}.{k}", pairs, _sub(raw, k))
        return out
    if isinstance(recorded, list):
        if recorded and all(map(_is_record, recorded)) and all(map(_is_record, replayed)):
            return _match_records(recorded, replayed, path, pairs, raw)
        if len(recorded) != len(replayed):
            extra = ", ".join(filter(None, (_label(v) for v in replayed[len(recorded):] if isinstance(v, dict))))
            return [f"{path}: {len(recorded)} items recorded, {len(replayed)} replayed{': ' + extra if extra else ''}"]
        return [d for i, (a, b) in enumerate(zip(recorded, replayed))
                for d in _compare(a, b, f"{path}[{i}]", pairs, _sub(raw, i))]
    return [] if recorded == replayed else [f"{path}: {recorded!r:.80} != {replayed!r:.80}"]


def _sub(raw: tuple[Any, Any], key: Any) -> tuple[Any, Any]:
    def get(v: Any) -> Any:
        try:
            return v[key]
        except (KeyError, IndexError, TypeError):
            return None
    return get(raw[0]), get(raw[1])


def _match_records(recorded: list, replayed: list, path: str, pairs: list[tuple[Any, Any]],
                   raw: tuple[Any, Any]) -> list[str]:
    """Every recorded record needs an equal replayed one, in any order; extra replayed records are allowed."""
    out, free = [], list(range(len(replayed)))
    for i, want in enumerate(recorded):
        closest: list[str] | None = None
        for j in free:
            inner: list[tuple[Any, Any]] = []
            pair = _sub(raw, i)[0], _sub(raw, j)[1]
            differences = _compare(want, replayed[j], f"{path}[{i}]", inner, pair)
            if not differences:
                free.remove(j)
                pairs += [pair, *inner]
                break
            if closest is None or len(differences) < len(closest):
                closest = differences
        else:
            why = f"; the closest replayed item differs: {closest[:3]}" if closest else ""
            label = _label(want)
            out.append(f"{path}[{i}]{' ' + label if label else ''}: no replayed item matches{why}")
    return out


def diff(recorded: Any, replayed: Any, path: str = "$") -> list[str]:
    """Differences between two responses after masking, each with its JSON path."""
    return _compare(mask(recorded), mask(replayed), path)


def _learn_ids(recorded: Any, replayed: Any) -> dict[str, str]:
    """The id mapping from a matched pair of responses: records aligned as the comparison aligned them."""
    pairs: list[tuple[Any, Any]] = []
    _compare(mask(recorded), mask(replayed), "$", pairs, (_about_the_job(recorded), _about_the_job(replayed)))
    ids: dict[str, str] = {}
    for want, got in [(recorded, replayed), *pairs]:
        if isinstance(want, dict) and isinstance(got, dict):
            ids.update({want[k]: got[k] for k in ("id", "anomaly_id", "fix_id")
                        if isinstance(want.get(k), str) and ID.match(want[k]) and isinstance(got.get(k), str)})
    return ids


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
    """Send the recorded calls again; a poll (calls repeated until the state changed) is repeated until its
    recorded answer comes back or ``timeout`` passes. Once a call has differed the session has diverged and
    later ones are sent once, not waited for: a drifted recording fails in one timeout with its first
    difference, instead of one timeout a call."""
    report = Report(calls=len(calls))
    ids: dict[str, str] = {}
    for group in _groups(calls):
        want = group[-1]
        expected = mask({"is_error": want["is_error"], "structured": want.get("structured")})
        arguments = _rewrite(want["arguments"], ids)
        deadline = time.monotonic() + (0.0 if report.mismatches else timeout)
        while True:
            result = await client.call_tool(want["tool"], arguments)
            report.sent += 1
            got = {"is_error": result.is_error, "structured": result.structured_content}
            differences = _compare(expected, mask(got), "$")
            if not differences or time.monotonic() > deadline:
                break
            await asyncio.sleep(poll)
        if differences:
            report.mismatches.append(Mismatch(want["seq"], want["tool"], differences))
            continue
        ids.update(_learn_ids(want.get("structured"), got["structured"]))
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
