"""Pure helpers for talking to Redis: RESP packing of XADD from buffers, reply parsing, URL redaction.

Kept apart from :mod:`streamgrpo.transport.queue.redis_stream` (the queue's behaviour) because these are plain
functions over bytes and lists, unit-testable without a server. Reply shapes are RESP2 (the
queue's client sets ``protocol=2``), as Redis 6.2 and 7.x send them.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

# The queue's bookkeeping runs as Lua scripts, so every decision about an entry is atomic on the
# server. Keys: stream, trained (zset gid -> time trained), held (hash gid -> stream id of the entry a
# learner accepted and has not committed), failures (hash gid -> training failures, gid:err -> last error).
#
# Redis at maxmemory refuses a command that may grow memory (HSET, ZADD, XADD, SET...), but inside a
# script only as long as the script has written nothing yet: once it has, Redis lets it finish (it
# cannot stop half-way; Redis 6.2 and 7.x alike). So every script below starts with a write Redis never
# refuses (HDEL of the empty field, which no group id is): the learner's bookkeeping -- holding a
# group, committing, releasing, dead-lettering, counting a failure -- goes on at maxmemory. Each adds at
# most a few hundred bytes per group, and the commit it leads to frees the groups' messages: refusing
# them would leave nothing able to free memory (a deadlock).
OOM_PASS = "redis.call('HDEL', KEYS[3], '')  -- never refused at maxmemory: lets the script finish (see above)\n"

# HOLD: a consumer claims each decoded entry for training. Per (gid, sid) pair, in order:
#   1 = already trained (within the horizon), 2 = another live entry holds this group id (a duplicate),
#   3 = its training failed max_failures times, 0 = held now (or already held by this very entry).
# A holder whose stream entry is gone (deleted by hand) does not block a new entry.
HOLD_LUA = OOM_PASS + """
local horizon, max_fail = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV, 2 do
  local gid, sid = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', KEYS[2], gid)
  local holder = redis.call('HGET', KEYS[3], gid)
  if score and tonumber(score) >= horizon then
    out[#out + 1] = 1
  elseif holder and holder ~= sid and #redis.call('XRANGE', KEYS[1], holder, holder) > 0 then
    out[#out + 1] = 2
  elseif max_fail > 0 and tonumber(redis.call('HGET', KEYS[4], gid) or '0') >= max_fail then
    out[#out + 1] = 3
  else
    redis.call('HSET', KEYS[3], gid, sid)
    out[#out + 1] = 0
  end
end
return out
"""

# RELEASE: acknowledge and delete entries that will not be trained (dropped, duplicate, dead-lettered)
# and forget their hold when they own it. ARGV: consumer group, then (sid, gid) pairs (gid may be '').
RELEASE_LUA = OOM_PASS + """
local acked = 0
for i = 2, #ARGV, 2 do
  local sid, gid = ARGV[i], ARGV[i + 1]
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], sid)
  redis.call('XDEL', KEYS[1], sid)
  if gid ~= '' and redis.call('HGET', KEYS[3], gid) == sid then
    redis.call('HDEL', KEYS[3], gid)
    redis.call('HDEL', KEYS[4], gid, gid .. ':err')
  end
end
return acked
"""

# COMMIT: the entries' training is durable (in a checkpoint): remember the group ids as trained,
# acknowledge and delete the entries, drop their holds and failure counts -- one atomic step.
# ARGV: consumer group, now, horizon, ttl seconds, the checkpoint's step (-1: none), n, then n field/value
# pairs of the data cursor, then (sid, gid) pairs. KEYS[5] keeps the highest step committed: a resume from an
# older checkpoint would lose what the newer one committed, and the learner refuses it. KEYS[6], the data
# cursor (field "<num_shards>/<shard>" -> "<epoch> <position> <step>"), is written with a step at least the one
# committed: the cursor of the checkpoint whose groups are committed, never one ahead of them.
COMMIT_LUA = OOM_PASS + """
local acked = 0
local step, n = tonumber(ARGV[5]), tonumber(ARGV[6])
if step >= 0 then
  local prev = tonumber(redis.call('GET', KEYS[5]) or '-1')
  if prev < step then
    redis.call('SET', KEYS[5], ARGV[5])
  end
  if step >= prev then
    for i = 7, 6 + 2 * n, 2 do
      redis.call('HSET', KEYS[6], ARGV[i], ARGV[i + 1])
    end
  end
end
for i = 7 + 2 * n, #ARGV, 2 do
  local sid, gid = ARGV[i], ARGV[i + 1]
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], sid)
  redis.call('XDEL', KEYS[1], sid)
  redis.call('ZADD', KEYS[2], ARGV[2], gid)
  if redis.call('HGET', KEYS[3], gid) == sid then
    redis.call('HDEL', KEYS[3], gid)
  end
  redis.call('HDEL', KEYS[4], gid, gid .. ':err')
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return acked
"""

# FAIL: count one failed training attempt per group id (and keep the last error); returns the counts.
FAIL_LUA = """
redis.call('HDEL', KEYS[1], '')  -- never refused at maxmemory (see above)
local out = {}
for i = 2, #ARGV do
  out[#out + 1] = redis.call('HINCRBY', KEYS[1], ARGV[i], 1)
  redis.call('HSET', KEYS[1], ARGV[i] .. ':err', ARGV[1])
end
return out
"""

# DEAD: release one entry (as RELEASE) and add its dead letter to KEYS[5], capped at about ARGV[4]
# entries. The release comes first: at maxmemory it frees the entry and lets the XADD through.
# ARGV: consumer group, sid, gid, maxlen, then the letter's field/value pairs.
DEAD_LUA = OOM_PASS + """
local sid, gid = ARGV[2], ARGV[3]
redis.call('XACK', KEYS[1], ARGV[1], sid)
redis.call('XDEL', KEYS[1], sid)
if gid ~= '' and redis.call('HGET', KEYS[3], gid) == sid then
  redis.call('HDEL', KEYS[3], gid)
  redis.call('HDEL', KEYS[4], gid, gid .. ':err')
end
local letter = {}
for i = 5, #ARGV do
  letter[#letter + 1] = ARGV[i]
end
return redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', unpack(letter))
"""


def safe_url(url: str, mask: str | None = None) -> str:
    """The URL without its password: ``redis://user:secret@h:1/0`` -> ``redis://user@h:1/0``, or with
    ``mask`` in its place (``redis://user:***@h:1/0``: still shows that a password is set)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis url>"
    out = url
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        cred = parts.username or ""
        if mask is not None:
            cred += f":{mask}"
        out = out.replace(parts.netloc, f"{cred}@{host}" if cred else host, 1)
    return re.sub(r"([?&](?:ssl_)?password=)[^&]*", r"\1***", out)


def xadd_command(stream: bytes, fields: list[tuple[bytes, list[Any]]]) -> list[Any]:
    """RESP for ``XADD stream * f1 v1 ...`` where each value is a list of buffers (sent as they are)."""
    out: list[Any] = [b"*%d\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n" % (3 + 2 * len(fields), len(stream), stream)]
    for name, parts in fields:
        size = sum(memoryview(p).nbytes for p in parts)
        out.append(b"$%d\r\n%s\r\n$%d\r\n" % (len(name), name, size))
        out += parts
        out.append(b"\r\n")
    return out


def command(*args: bytes) -> bytes:
    """RESP of one command of small byte-string arguments (e.g. ``XLEN key``)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def coalesce(chunks: list[Any], small: int = 64 << 10) -> list[Any]:
    """Join runs of small buffers (one send call each otherwise); large ones pass through uncopied."""
    out: list[Any] = []
    run: list[Any] = []
    for c in chunks:
        if memoryview(c).nbytes < small:
            run.append(c)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(c)
    if run:
        out.append(b"".join(run))
    return out


def to_str(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def parse_entries(raw: Any) -> list[tuple[str, dict[bytes, bytes] | None]]:
    """``[[id, [f1, v1, ...]], ...]`` -> ``[(id, {f1: v1}), ...]``; a deleted entry (nil fields) gives ``(id, None)``."""
    out = []
    for item in raw or []:
        if not isinstance(item, (list, tuple)) or not item:
            continue  # Redis 6.2 XAUTOCLAIM may return a bare nil for an entry deleted while pending
        sid = to_str(item[0])
        fields = item[1] if len(item) > 1 else None
        out.append((sid, None if fields is None else dict(zip(fields[::2], fields[1::2]))))
    return out


def parse_autoclaim(raw: Any) -> tuple[str, list[tuple[str, dict[bytes, bytes] | None]], list[str]]:
    """XAUTOCLAIM reply -> (next cursor, entries, deleted ids).

    Redis 6.2 replies ``[cursor, entries]``; 7.x adds a third element, the ids of pending entries
    that no longer exist (7.x already removed them from the pending list).
    """
    if not isinstance(raw, (list, tuple)) or len(raw) not in (2, 3):
        raise ValueError(f"unexpected XAUTOCLAIM reply: {raw!r:.200}")
    deleted = [to_str(x) for x in raw[2]] if len(raw) == 3 and raw[2] else []
    return to_str(raw[0]), parse_entries(raw[1]), deleted
