"""Weight broadcast throughput vs raw ZeroMQ and memcpy, the learner's stall, the generator's apply pause.

For each size in ``--mib`` (default 256,1024) and each subscriber count in ``--subs`` (1,2,4),
publishes that many MiB of bfloat16 tensors from this process to subscriber processes over TCP
loopback (and ``ipc://`` with ``--transports tcp,ipc``), ``--repeats`` times, and compares with a raw
ZeroMQ PUB/SUB transfer of the same bytes in the same chunks, in the same run and process layout
(baseline: the subscriber only receives frames; no copy, digest or apply). Combinations that would
not fit in this machine's memory are skipped and said so.

* ``weights_<mib>m_<n>sub[_ipc]_GBps``: bytes / (publish() called -> every subscriber's poll()
  returned the verified version); baseline: raw bytes / (first send -> every subscriber holds every
  byte). Goal: ratio >= 0.9.
* ``applied_<...>_s``: publish() called -> the last subscriber applied it to its model; baseline:
  the raw transfer.
* ``publish_call_<...>_s``: how long ``publish()`` blocks the learner (CPU tensors: the one copy out),
  against the transfer time.
* ``apply_pause_<...>_s``: what a generator stops for (``apply_to_model``, ``mark_applied``, ``poll(0)``).
* ``memcpy_GBps`` / ``xxh3_128_GBps``: single-thread context of the same run.

Prints ``name: value (baseline: value, ratio: x)`` lines and writes
``benchmarks/results/bench_weights.json`` with machine info. Medians over repeats.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_weights [--mib 256,1024] [--subs 1,2,4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import child_pythonpath, emit, figure, machine_info, module_argv, write_result


def _tensors(mib: int, fill: bool = True):
    """bfloat16 tensors of mixed shapes totalling ``mib`` MiB, all views of one flat buffer (returned
    too, so the raw baseline sends the same memory); ``fill=False`` leaves them zero (a model)."""
    import torch

    total = mib << 20
    flat = torch.zeros(total // 2, dtype=torch.bfloat16)
    if fill:  # content does not change the cost of the wire or of xxh3; a pattern is cheap to make
        flat.view(torch.int16).copy_(torch.arange(total // 2, dtype=torch.int32).to(torch.int16))
    shapes = [(2048, 1024), (1024, 1024), (4096, 256), (1024,), (333, 77)]
    out, used, i = {}, 0, 0
    while used < total:
        shape = shapes[i % len(shapes)]
        n = 1
        for s in shape:
            n *= s
        if used + 2 * n > total:
            shape, n = ((total - used) // 2,), (total - used) // 2
        out[f"w{i}"] = flat[used // 2 : used // 2 + n].view(shape)
        used += 2 * n
        i += 1
    return out, flat


WAIT_S = 300.0
"""The longest any wait of this benchmark (a subscriber for the publisher, the driver for a subscriber) lasts."""


def _emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


# -------------------------------------------------------------------------------- subscriber roles
def _sub_raw(a) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.rcvhwm = 0
    if a.keys:
        from streamgrpo.transport.weights.keys import client_keys, server_keys

        sock.curve_serverkey = server_keys(a.keys, secret=False)[0]
        sock.curve_publickey, sock.curve_secretkey = client_keys(a.keys, None)
    sock.subscribe(b"")
    sock.rcvtimeo = int(WAIT_S * 1000)
    sock.connect(a.endpoint)
    got: dict[int, int] = {}
    warm = False
    while True:
        try:
            frames = sock.recv_multipart(copy=False)
        except zmq.Again:
            sys.exit(f"bench_weights raw subscriber: nothing from {a.endpoint} for {WAIT_S:.0f}s; giving up")
        tag = frames[0].bytes
        if tag == b"warm":
            if not warm:
                warm = True
                _emit(event="warm")
            continue
        if tag == b"stop":
            return
        r = int(frames[1].bytes)
        got[r] = got.get(r, 0) + len(frames[2])
        if got[r] >= a.nbytes:
            _emit(event="done", round=r, t=time.monotonic())


def _sub_weights(a) -> None:
    import torch

    from streamgrpo.models.apply import apply_to_model
    from streamgrpo.transport.weights.shm_subscriber import ShmSubscriber
    from streamgrpo.transport.weights.subscriber import WeightSubscriber

    model = torch.nn.Module()
    for name, t in _tensors(a.mib, fill=False)[0].items():
        model.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    shm = {"shm_dir": a.shm_dir} if a.shm_dir else {}
    sub = (ShmSubscriber if shm else WeightSubscriber)("127.0.0.1", a.port, a.snap, a.keys, None,
                                                       ipc_dir=a.ipc_dir or None, **shm)
    last = time.monotonic()
    while True:
        got = sub.poll(60.0)  # a generator would call poll(0) between batches; waiting here costs no CPU
        if got is None:
            if time.monotonic() - last > WAIT_S:
                sys.exit(f"bench_weights subscriber: no weight version for {WAIT_S:.0f}s; giving up")
            continue
        last = time.monotonic()
        t_done = time.monotonic()
        version, tensors = got
        apply_to_model(model, tensors)
        sub.mark_applied()  # observes the sync histogram and recycles the receive buffer
        sub.poll(0.0)  # the between-batches check itself is part of the pause
        t2 = time.monotonic()
        _emit(event="done", round=version, t=t_done, t_applied=t2, pause=t2 - t_done, stats=sub.stats)
        if version >= a.rounds:
            break
    sub.close()


# ------------------------------------------------------------------------------------------ driver
class Child:
    def __init__(self, args: list[str]):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath())
        self.p = subprocess.Popen(module_argv("bench_weights", *args), stdout=subprocess.PIPE, text=True, env=env)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("{"):
                self.q.put(json.loads(line))

    def get(self, timeout: float = WAIT_S) -> dict:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"subscriber process sent nothing for {timeout:.0f}s (exit code {self.p.poll()})") from None

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
        self.p.wait(10)


class RawChannel:
    """Baseline: a bare PUB socket sending the same bytes in the same chunks to bare SUB processes."""

    def __init__(self, n_subs: int, payload, chunk: int, keys: str | None, ipc_dir: str | None, io_threads: int):
        import zmq

        self.ctx = zmq.Context(io_threads=io_threads)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.sndhwm = 0  # never drop: the baseline has no repair path
        self.auth = None
        if keys:
            from zmq.auth.thread import ThreadAuthenticator

            from streamgrpo.transport.weights.keys import authorised_dir, server_keys

            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(authorised_dir(keys)))
            self.pub.curve_server = True
            self.pub.curve_publickey, self.pub.curve_secretkey = server_keys(keys, secret=True)
        if ipc_dir:
            ep = f"ipc://{ipc_dir}/raw.sock"
            self.pub.bind(ep)
        else:
            ep = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.payload = memoryview(payload.view(__import__("torch").uint8).numpy())
        self.nbytes, self.chunk = len(self.payload), chunk
        self.subs = [Child(["--role", "raw", "--endpoint", ep, "--nbytes", str(self.nbytes)] + (["--keys", keys] if keys else []))
                     for _ in range(n_subs)]
        for c in self.subs:  # slow joiner: keep sending warm-up frames until everyone is subscribed
            deadline = time.monotonic() + WAIT_S
            while True:
                if time.monotonic() > deadline or c.p.poll() is not None:
                    raise RuntimeError(f"raw subscriber not subscribed after {WAIT_S:.0f}s (exit code {c.p.poll()})")
                self.pub.send_multipart([b"warm", b"", b""])
                try:
                    if c.q.get(timeout=0.05)["event"] == "warm":
                        break
                except queue.Empty:
                    pass

    def transfer(self, r: int) -> float:
        t0 = time.monotonic()
        for off in range(0, self.nbytes, self.chunk):
            self.pub.send_multipart([b"w", str(r).encode(), self.payload[off : off + self.chunk]], copy=False)
        return max(c.get()["t"] for c in self.subs) - t0

    def close(self) -> None:
        self.pub.send_multipart([b"stop", b"", b""])
        for c in self.subs:
            c.stop()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)


class WeightsChannel:
    """Ours: WeightPublisher here, WeightSubscriber + apply_to_model in each subscriber process."""

    def __init__(self, n_subs: int, tensors, mib: int, chunk_mib: float, rounds: int, keys: str | None,
                 ipc_dir: str | None, io_threads: int, shm_dir: str | None = None):
        from streamgrpo.transport.weights.publisher import WeightPublisher
        from streamgrpo.transport.weights.shm_publisher import ShmPublisher

        self.tensors = tensors
        shm = {"shm_dir": shm_dir} if shm_dir else {}
        self.pub = (ShmPublisher if shm else WeightPublisher)("127.0.0.1", 0, 0, chunk_mib, keys, ipc_dir=ipc_dir,
                                                              io_threads=io_threads, **shm)
        self.subs = [Child(["--role", "weights", "--port", str(self.pub.pub_port), "--snap", str(self.pub.snapshot_port),
                            "--mib", str(mib), "--rounds", str(rounds)] + (["--keys", keys] if keys else [])
                           + (["--ipc-dir", ipc_dir] if ipc_dir else []) + (["--shm-dir", shm_dir] if shm_dir else []))
                     for _ in range(n_subs)]
        self.version = 1
        self.pub.publish(1, self.tensors)  # warm-up version (late subscribers get it from the snapshot)
        for c in self.subs:
            c.get()

    def transfer(self) -> dict:
        self.version += 1
        t0 = time.monotonic()
        self.pub.publish(self.version, self.tensors)
        call = time.monotonic() - t0
        done = [c.get() for c in self.subs]
        assert all(d["round"] == self.version for d in done), done
        return {"secs": max(d["t"] for d in done) - t0, "applied": max(d["t_applied"] for d in done) - t0,
                "pause": max(d["pause"] for d in done), "publish_call": call, "stats": [d["stats"] for d in done]}

    def close(self) -> None:
        for c in self.subs:
            c.stop()
        self.pub.close()


def run_pair(n_subs: int, mib: int, chunk_mib: float, repeats: int, keys: str | None, ipc: bool = False,
             io_threads: int = 1, shm: bool = False) -> dict:
    """Both channels up at once; each repeat runs a raw transfer, then ours, so both see the same load.
    ``shm``: ours reads versions from shared memory (announced over ipc); the raw baseline is ipc."""
    tensors, flat = _tensors(mib)
    tmp = tempfile.TemporaryDirectory(prefix="sg-bw-") if ipc or shm else None
    shm_dir = tempfile.mkdtemp(prefix="sg-bw-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) if shm else None
    raw = RawChannel(n_subs, flat, int(chunk_mib * (1 << 20)), keys, tmp and tmp.name, io_threads)
    ours = WeightsChannel(n_subs, tensors, mib, chunk_mib, repeats + 2, keys, tmp and tmp.name, io_threads, shm_dir)
    out: dict = {"raw_secs": [], "secs": [], "applied": [], "pause": [], "publish_call": [], "ratio": []}
    try:
        ours.transfer()  # one untimed round each: buffers warm, connections settled
        raw.transfer(0)
        for r in range(1, repeats + 1):
            time.sleep(0.2)
            raw_s = raw.transfer(r)
            time.sleep(0.2)
            o = ours.transfer()
            out["raw_secs"].append(raw_s)
            for k in ("secs", "applied", "pause", "publish_call"):
                out[k].append(o[k])
            out["ratio"].append(raw_s / o["secs"])
            out["stats"] = o["stats"]
    finally:
        raw.close()
        ours.close()
        if tmp is not None:
            tmp.cleanup()
        if shm_dir is not None:
            os.rmdir(shm_dir)  # the publisher removed its files at close
    return out


def cpu_costs(mib: int) -> dict:
    """Single-thread costs of the work our path adds per version (context for the ratio on small machines)."""
    import torch

    from streamgrpo.transport.weights.codec import chunk_digest
    from streamgrpo.transport.weights.layout import pack_into, plan_layout, specs_of

    tensors, _ = _tensors(mib)
    layout = plan_layout(specs_of(tensors))
    nbytes = layout.nbytes
    buf = torch.empty(nbytes, dtype=torch.uint8)
    pack_into(buf, tensors, layout)  # fault the pages in first
    t0 = time.perf_counter()
    pack_into(buf, tensors, layout)
    t1 = time.perf_counter()
    chunk_digest("xxh3_128", memoryview(buf.numpy()))
    t2 = time.perf_counter()
    return {"memcpy_GBps": nbytes / (t1 - t0) / 1e9, "xxh3_128_GBps": nbytes / (t2 - t1) / 1e9}


def weights_machine_info() -> dict:
    import torch  # noqa: F401  (machine_info reports its thread count)
    import zmq

    return machine_info(packages=("numpy", "torch", "pyzmq", "xxhash"), libzmq=zmq.zmq_version())


_MAIN_ARGS = ("mib", "chunk_mib", "repeats", "subs", "curve", "transports", "io_threads")


def _fits(mib: int, n_subs: int) -> bool:
    """Publisher (tensors + up to 3 version buffers) and subscribers (model + 2 receive buffers each)
    within 80% of this machine's memory."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (4 + 3 * n_subs) * (mib << 20) <= 0.8 * total


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_weights", description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["main", "raw", "weights"], default="main")
    ap.add_argument("--mib", default="256,1024", help="payload sizes in MiB, comma-separated")
    ap.add_argument("--chunk-mib", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--subs", default="1,2,4")
    ap.add_argument("--transports", default="tcp", help="comma-separated: tcp, ipc, shm (shared memory; raw baseline: ipc)")
    ap.add_argument("--io-threads", type=int, default=1, help="ZeroMQ I/O threads of both publishers")
    ap.add_argument("--curve", action="store_true", help="also run both paths with CURVE encryption (tcp)")
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_weights.json)")
    ap.add_argument("--endpoint")
    ap.add_argument("--port", type=int)
    ap.add_argument("--snap", type=int)
    ap.add_argument("--ipc-dir", default="")
    ap.add_argument("--shm-dir", default="")
    ap.add_argument("--nbytes", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--keys")
    a = ap.parse_args()
    if a.role == "raw":
        return _sub_raw(a)
    if a.role == "weights":
        a.mib = int(a.mib)
        return _sub_weights(a)

    sizes = [int(x) for x in a.mib.split(",")]
    machine = weights_machine_info()
    results: dict = {"chunk_mib": a.chunk_mib, "repeats": a.repeats, "runs": {}, "skipped": []}
    figures: list[dict] = []
    modes = [(t, None) for t in a.transports.split(",")]
    tmp = None
    if a.curve:
        from streamgrpo.transport.weights.keys import generate_keys

        tmp = tempfile.TemporaryDirectory()
        modes.append(("curve", str(generate_keys(tmp.name, clients=1).keys_dir)))
    for mib in sizes:
        nbytes = mib << 20
        for mode, keys in modes:
            for n in [int(x) for x in a.subs.split(",")]:
                name = f"{mib}m_{n}sub" + ("" if mode == "tcp" else f"_{mode}")
                if not _fits(mib, n):
                    print(f"# skipped {name}: {mib} MiB x {n} subscribers does not fit in this machine's memory")
                    results["skipped"].append(name)
                    continue
                res = run_pair(n, mib, a.chunk_mib, a.repeats, keys, ipc=mode == "ipc", io_threads=a.io_threads,
                               shm=mode == "shm")
                raw_s, ours_s = statistics.median(res["raw_secs"]), statistics.median(res["secs"])
                applied = statistics.median(res["applied"])
                pause, call = statistics.median(res["pause"]), statistics.median(res["publish_call"])
                gbps, raw_gbps = nbytes / ours_s / 1e9, nbytes / raw_s / 1e9
                ratio = statistics.median(res["ratio"])  # per-repeat pairs: robust to load drifting
                figures.append(emit(figure(f"weights_{name}_GBps", gbps, raw_gbps, ratio, unit="GB/s",
                                           note="baseline: raw ZeroMQ PUB/SUB of the same bytes and chunks. Goal >= 0.9")))
                figures.append(emit(figure(f"applied_{name}_s", applied, raw_s, unit="s",
                                           note="publish() -> last subscriber applied; baseline: the raw transfer")))
                figures.append(emit(figure(f"publish_call_{name}_s", call, ours_s, unit="s",
                                           note="learner blocked in publish(); baseline: the transfer time")))
                figures.append(emit(figure(f"apply_pause_{name}_s", pause, ours_s, unit="s",
                                           note="baseline: the transfer time of a version")))
                results["runs"][name] = {
                    **res, "ratios": res["ratio"], "mib": mib, "subs": n, "transport": mode, "weights_GBps": gbps,
                    "raw_GBps": raw_gbps, "ratio": ratio, "applied_s": applied, "apply_pause_s": pause,
                    "transfer_s": ours_s, "publish_call_s": call,
                }
    costs = cpu_costs(min(sizes))
    results["cpu_costs"] = costs
    best = max((r["weights_GBps"] for r in results["runs"].values()), default=None)
    figures.append(emit(figure("memcpy_GBps", costs["memcpy_GBps"], None, unit="GB/s",
                               note="single-thread copy of the payload, same run")))
    if best is not None:
        figures.append(emit(figure("best_weights_vs_memcpy_GBps", best, costs["memcpy_GBps"], unit="GB/s",
                                   note="the fastest broadcast above against one memcpy of the same bytes")))
    print(f"# context: memcpy {costs['memcpy_GBps']:.2f} GB/s, xxh3_128 {costs['xxh3_128_GBps']:.2f} GB/s single-threaded; "
          f"our path adds 1 copy + 1 hash on each side of the wire (in worker threads), plus the apply copy")
    write_result("bench_weights", figures, machine, {k: v for k, v in vars(a).items() if k in _MAIN_ARGS},
                 results, a.out)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
