"""Weights to H hosts x G generators on loopback: one relay per "host" against every generator on TCP.

Each simulated host has its own shared-memory folder, its relay (``streamgrpo relay``, a process) and
one process running its G generators' weight subscribers (``weights.relay``: they read the relay's
shared-memory files), each of which applies every version to a model-shaped set of tensors. The
learner is a :class:`WeightPublisher` in this process, publishing ``--mib`` MiB of bf16 per version.

* ``relay_<H>h<G>g_egress_bytes``: bytes the learner sent per version (the loopback interface's TX
  counter from publish to the last generator applied, ``/proc/net/dev``), against H x G x payload
  (every generator on TCP, what the learner sends without relays); goal: H x payload.
* ``relay_<H>h<G>g_last_applied_s``: publish -> the last of the H x G generators applied it; baseline:
  one generator on TCP, alone (goal: ratio <= 1.2).
* ``direct_<H>h<G>g_last_applied_s`` (``--direct``): the same H x G generators, each on TCP; baseline as above.

Medians over ``--repeats`` versions after a warm-up one. Prints ``name: value (baseline, ratio)`` lines
and writes ``benchmarks/results/bench_relay.json``.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_relay [--mib 128] [--hosts 2,4] [--gens 1,4] [--repeats 3]
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
from pathlib import Path

from benchmarks.common import child_pythonpath, emit, figure, machine_info, module_argv, write_result

WAIT_S = 300.0


def _lo_tx() -> int:
    """Bytes sent on the loopback interface so far."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _config(run_dir: Path, pub, shm: Path | None):
    from streamgrpo.config import build_config

    sets = [f"run_dir={run_dir}", f"weights.pub_port={pub.pub_port}", f"weights.snapshot_port={pub.snapshot_port}",
            "metrics.port=0"]
    if shm is not None:
        sets += [f"weights.shm_dir={shm}", "weights.relay=true"]
    return build_config({}, sets)


# ------------------------------------------------------------------------------------ host worker
def _worker(a) -> None:
    """G subscribers (threads) of one host, from the config file: one JSON line per applied version."""
    import torch

    from streamgrpo.config import load_config
    from streamgrpo.transport.weights.factory import subscriber_from_config

    cfg = load_config(a.config)
    lock = threading.Lock()

    def one(k: int) -> None:
        sub = subscriber_from_config(cfg.weights, cfg.run_dir)
        model: dict[str, torch.Tensor] = {}
        last = time.monotonic()
        while True:
            got = sub.poll(1.0)
            if got is None:
                if time.monotonic() - last > WAIT_S:
                    break
                continue
            last = time.monotonic()
            version, tensors = got
            for n, t in tensors.items():
                model.setdefault(n, torch.empty_like(t)).copy_(t)
            sub.mark_applied()
            with lock:
                print(json.dumps({"sub": k, "version": version, "t": time.time()}), flush=True)
            if version >= a.last:
                break
        sub.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(a.gens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Proc:
    def __init__(self, argv: list[str], log: Path | None = None):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath())
        self.q: queue.Queue = queue.Queue()
        out = subprocess.PIPE if log is None else open(log, "wb")
        self.p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if log else None, text=log is None, env=env)
        if log is None:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("{"):
                self.q.put(json.loads(line))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)


def run(hosts: int, gens: int, tensors, mib: int, repeats: int, mode: str, work: Path) -> dict:
    """mode: relay (a relay per host) or direct (every generator on TCP). Per version: seconds to the last
    generator applied, and loopback bytes sent meanwhile."""
    from streamgrpo.transport.weights.publisher import WeightPublisher

    pub = WeightPublisher("127.0.0.1", 0, 0)
    last = repeats + 1
    procs: list[Proc] = []
    workers: list[Proc] = []
    try:
        for h in range(hosts):
            shm = None
            if mode == "relay":
                shm = work / f"host{h}" / "shm"
                shm.mkdir(parents=True, exist_ok=True)
            cfg = _config(work / f"host{h}" / "run", pub, shm)
            path = work / f"host{h}" / "config.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(cfg.to_yaml())
            if mode == "relay":
                procs.append(Proc([sys.executable, "-m", "streamgrpo", "relay", "--config", str(path)],
                                  log=work / f"host{h}" / "relay.log"))
            workers.append(Proc(module_argv("bench_relay", "--worker", "--config", str(path), "--gens", str(gens),
                                            "--last", str(last))))
        n = hosts * gens
        version, out = 0, []
        pub.publish(version, tensors)  # warm-up: everyone connected, buffers made
        _collect(workers, version, n)
        for version in range(1, last + 1):
            time.sleep(0.5)  # heartbeats and snapshot traffic settle
            tx0, t0 = _lo_tx(), time.time()
            pub.publish(version, tensors)
            done = _collect(workers, version, n)
            out.append({"secs": max(done) - t0, "egress": _lo_tx() - tx0, "subscribers": pub.subscribers})
        return {"secs": statistics.median(r["secs"] for r in out), "egress": statistics.median(r["egress"] for r in out),
                "subscribers": out[-1]["subscribers"], "runs": out}
    finally:
        for p in workers + procs:
            p.stop()
        pub.close()


def _collect(workers: list[Proc], version: int, n: int) -> list[float]:
    times: list[float] = []
    deadline = time.monotonic() + WAIT_S
    while len(times) < n:
        for w in workers:
            try:
                while True:
                    msg = w.q.get_nowait()
                    if msg["version"] == version:
                        times.append(msg["t"])
            except queue.Empty:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(times)} of {n} generators applied v{version} in {WAIT_S:.0f} s")
        time.sleep(0.01)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--gens", default="1,4")
    ap.add_argument("--last", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--hosts", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--direct", action="store_true", help="also every generator on TCP (the learner's fan-out)")
    a = ap.parse_args()
    if a.worker:
        a.gens = int(a.gens)
        return _worker(a)

    from benchmarks.bench_weights import _tensors

    tensors, _ = _tensors(a.mib)
    payload = sum(t.numel() * t.element_size() for t in tensors.values())
    figs = []
    with tempfile.TemporaryDirectory(prefix="bench_relay-") as tmp:
        work = Path(tmp)
        single = run(1, 1, tensors, a.mib, a.repeats, "direct", work / "single")
        print(f"# one generator on TCP: {single['secs']:.3f} s per {a.mib} MiB version")
        data = {"single": single}
        for h in [int(x) for x in a.hosts.split(",")]:
            for g in [int(x) for x in a.gens.split(",")]:
                r = run(h, g, tensors, a.mib, a.repeats, "relay", work / f"relay{h}x{g}")
                data[f"relay_{h}h{g}g"] = r
                figs.append(emit(figure(f"relay_{h}h{g}g_egress_bytes", r["egress"], h * g * payload, unit="bytes",
                                        note=f"learner egress per version; goal {h} x payload = "
                                             f"{h / (h * g):.2f} of the baseline; {r['subscribers']} PUB connections")))
                figs.append(emit(figure(f"relay_{h}h{g}g_last_applied_s", r["secs"], single["secs"], unit="s",
                                        note="goal: ratio <= 1.2")))
                if a.direct:
                    d = run(h, g, tensors, a.mib, a.repeats, "direct", work / f"direct{h}x{g}")
                    data[f"direct_{h}h{g}g"] = d
                    figs.append(emit(figure(f"direct_{h}h{g}g_last_applied_s", d["secs"], single["secs"], unit="s",
                                            note=f"egress {d['egress'] / payload:.1f} x payload")))
    write_result("bench_relay", figs, machine_info(), {k: v for k, v in vars(a).items() if k != "worker"},
                 data={"payload_bytes": payload, **data})


if __name__ == "__main__":
    main()
