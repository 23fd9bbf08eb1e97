"""Chaos soak: the demo under kill -9 of the learner, a generator, redis-server and `up`, then an audit.

Runs a learner, ``--generators`` generator processes and a redis-server (AOF, ``appendfsync
always``, as ``streamgrpo up`` runs it) on loopback with the demo task, for ``--minutes``. Meanwhile, at seeded random moments,
it kills (SIGKILL, by PID) the learner ``--learner-kills`` times and a generator and redis-server
about a third as often each, restarting each at once (the learner with ``--resume``, the same
generator id, redis-server on the same port and AOF); one learner kill waits until the learner is
writing a checkpoint (``step-N.tmp`` exists) and kills it then. Then it stops the generators and
the learner with SIGTERM (a clean stop: final checkpoint and commit). With ``--up-minutes``, the same
run goes on under ``streamgrpo up --resume`` (same run directory, same Redis): `up` is killed with
-9 (its children stop with it: SIGTERM from the kernel) and restarted, then sent SIGHUP (a closed
terminal: a clean stop) and restarted, then stopped with SIGTERM. Before the first clean stop, the
huge-group phase: one valid group 16x the demo's pixels (taken: ``learner.max_group_pixels`` is raised for it) and one
over that limit go into the stream; the second is dead-lettered ``too_large``, and the learner is killed -9
each time a step holds the first (as an out-of-memory killer would) until a start dead-letters it as
``crash_loop``. With ``--maxmemory-minutes`` (before `up`), Redis' ``maxmemory`` is set under what it uses
for that long (writes refused until the learner's commit frees memory), then restored: nothing may exit,
and training goes on. Then it audits the run directory against Redis
(:mod:`benchmarks.audit`): every produced group is trained exactly once, or dropped with a counted
reason, or still queued; the step log runs 1..N with the policy version equal to the step.

Prints the kills, the audit and ``lost: N, twice: N``; exits 1 when either is above 0 or the step
log is out of order. Writes ``benchmarks/results/chaos.json``.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.chaos [--minutes 10] [--learner-kills 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import ROOT, child_pythonpath

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "WANDB_MODE": "disabled", "PYTHONPATH": child_pythonpath()}


@dataclass
class Kill:
    at_s: float
    target: str  # learner | learner-ckpt | generator-K | redis | up | up-hup
    step: int | None = None  # the learner's newest logged step when it happened
    note: str = ""


@dataclass
class Plan:
    """When to kill what (seconds from the start), spread over the middle of the run."""

    kills: list[tuple[float, str]] = field(default_factory=list)


def make_plan(duration_s: float, learner_kills: int, generators: int, seed: int) -> Plan:
    """``learner_kills`` learner kills and about a third as many generator and redis kills each, at
    seeded random moments in [10%, 85%] of the run (pure)."""
    rng = random.Random(seed)
    targets = ["learner-ckpt"] + ["learner"] * (learner_kills - 1) if learner_kills else []  # one while checkpointing
    targets += [f"generator-{rng.randrange(generators)}" for _ in range(max(1, learner_kills // 3))]
    targets += ["redis"] * max(1, learner_kills // 3)
    rng.shuffle(targets)
    lo, hi = 0.10 * duration_s, 0.85 * duration_s
    slots = sorted(rng.uniform(lo, hi) for _ in targets)
    return Plan(list(zip(slots, targets)))


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path):
        self.name, self.argv, self.log = name, argv, log
        self.p: subprocess.Popen | None = None
        self.started = 0.0
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as fh:
            self.p = subprocess.Popen(self.argv, env=ENV, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()

    def kill9(self, sig: int = signal.SIGKILL) -> None:
        if self.p is not None and self.p.poll() is None:
            os.kill(self.p.pid, sig)
        if self.p is not None:
            self.p.wait()

    def term(self, grace_s: float = 120.0) -> int | None:
        if self.p is None:
            return None
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.p.returncode


def _last_step(run_dir: Path) -> int:
    from benchmarks.audit import read_jsonl

    steps = [r["step"] for r in read_jsonl(run_dir / "audit" / "learner.jsonl") if r.get("event") == "trained"]
    return steps[-1] if steps else 0


def _resumes(run_dir: Path) -> int:
    from benchmarks.audit import read_jsonl

    return sum(r.get("event") == "resumed" for r in read_jsonl(run_dir / "audit" / "learner.jsonl"))


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _writing_checkpoint(run_dir: Path) -> str | None:
    tmp = sorted((run_dir / "checkpoints").glob("step-*.tmp")) if (run_dir / "checkpoints").is_dir() else []
    return tmp[-1].name if tmp else None


def _kill_while_checkpointing(learner: Proc, run_dir: Path, wait_s: float = 60.0) -> str:
    """Kill -9 the learner as soon as a checkpoint is being written (within ``wait_s``); say which."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and learner.p.poll() is None:
        name = _writing_checkpoint(run_dir)
        if name:
            learner.kill9()
            return f"while writing {name}"
        time.sleep(0.005)
    learner.kill9()
    return "no checkpoint was being written in time: killed anyway"


def _pids_gone(run_dir: Path, timeout_s: float) -> bool:
    """Wait until every process `up` recorded has exited (a killed `up`'s children stop by themselves)."""
    pids = list(json.loads((run_dir / "processes.json").read_text()).values())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().split(")")[-1].split()[0] != "Z":
                        alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _maxmemory_phase(url: str, run_dir: Path, procs: list[Proc], seconds: float, kills: list[Kill], t0: float,
                     log) -> None:
    """Redis at ``maxmemory`` for ``seconds``, from the learner's next step on: set under what it uses (half
    the stream's bytes less), so the generators are refused until the learner commits, then restored. Nothing may exit (a process that does
    is noted and restarted), and the learner must train a step after the restore."""
    import redis as redis_py

    r = redis_py.Redis.from_url(url)
    text = lambda x: x.decode() if isinstance(x, bytes) else str(x)  # noqa: E731
    try:
        start, wait_until = _last_step(run_dir), time.monotonic() + 180
        while _last_step(run_dir) <= start and time.monotonic() < wait_until:  # a learner that trains (not loading)
            time.sleep(0.5)
        used = int(r.info("memory")["used_memory"])
        stream = next((k for k in r.scan_iter(match="*:groups", count=1000)), None)
        held = int(r.memory_usage(stream) or 0) if stream else 0
        limit = max(1, used - max(held // 2, 1 << 16))
        old = {k: text(v) for k, v in r.config_get("maxmemory*").items() if text(k) in ("maxmemory", "maxmemory-policy")}
        kills.append(Kill(round(time.monotonic() - t0, 1), "redis-maxmemory", _last_step(run_dir)))
        log(f"[{time.monotonic() - t0:6.1f}s] redis maxmemory {limit >> 10} KiB (it uses {used >> 10} KiB) for "
            f"{seconds:.0f}s (learner at step {kills[-1].step})")
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", str(limit))
        oom = lambda: int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))  # noqa: E731
        exits, oom0 = [], oom()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for proc in procs:
                if proc.p.poll() is not None:
                    exits.append(f"{proc.name} (code {proc.p.returncode})")
                    log(f"  {proc.name} exited at maxmemory (code {proc.p.returncode}); restarting")
                    proc.start()
            time.sleep(0.5)
        at_restore, refused = _last_step(run_dir), oom() - oom0
        for key, value in old.items():
            r.config_set(key, value)
        deadline = time.monotonic() + 180
        while _last_step(run_dir) <= at_restore and time.monotonic() < deadline:
            time.sleep(0.5)
        after = _last_step(run_dir)
        kills[-1].note = (f"steps {kills[-1].step} -> {at_restore} at maxmemory, {after} after the restore; "
                          f"{refused} writes refused (OOM); exited: {', '.join(exits) or 'none'}")
        log(f"  {kills[-1].note}")
    finally:
        r.close()


def _up_phase(run_dir: Path, cfg_path: Path, generators: int, duration_s: float, kills: list[Kill], t0: float,
              log) -> None:
    """The run goes on under `up --resume`: kill -9 it, restart; SIGHUP it, restart; SIGTERM it."""
    argv = [sys.executable, "-m", "streamgrpo", "up", "--config", str(cfg_path), "--resume", "--generators",
            str(generators)]
    resumes = _resumes(run_dir)
    up = Proc("up", argv, run_dir / "logs" / "up.log")
    end = time.monotonic() + duration_s
    resumed = lambda n: _wait(lambda: _resumes(run_dir) > n, 180)  # noqa: E731 - its learner resumed (slow machines load slowly)
    try:
        for target, sig in (("up", signal.SIGKILL), ("up-hup", signal.SIGHUP)):
            time.sleep(max(5.0, duration_s / 3))
            resumed(resumes)
            kills.append(Kill(round(time.monotonic() - t0, 1), target, _last_step(run_dir)))
            log(f"[{time.monotonic() - t0:6.1f}s] {'kill -9' if sig == signal.SIGKILL else 'SIGHUP to'} up "
                f"(learner at step {kills[-1].step})")
            os.kill(up.p.pid, sig)
            up.p.wait(180)
            if not _pids_gone(run_dir, 180):
                kills[-1].note = "children still running after 180 s"
                log(f"  {kills[-1].note}")
            resumes = _resumes(run_dir)
            up.start()  # `up --resume` again: the learner resumes, the generators carry on
        resumed(resumes)
        time.sleep(max(0.0, end - time.monotonic()))
        log(f"[{time.monotonic() - t0:6.1f}s] stopping up (SIGTERM)")
        code = up.term(180)
        if code not in (0, 143, None):
            log(f"up's clean stop exited with {code}; see {up.log}")
    finally:
        up.kill9()


HUGE_SIDE, TOO_LARGE_SIDE = 224, 280  # frames of the huge groups (the demo's are 56 x 56)
HUGE_LIMIT = 4 * 240 * 240  # learner.max_group_pixels of the soak: 4 frames of 224 x 224 pass, of 280 x 280 not


def _stale_drops(run_dir: Path, group_id: str) -> int:
    from benchmarks.audit import read_jsonl

    return sum(r.get("event") == "dropped" and r.get("group_id") == group_id and r.get("reason") in ("stale", "rolled_back")
               for r in read_jsonl(run_dir / "audit" / "learner.jsonl"))


def _huge_group_phase(run_dir: Path, cfg, url: str, learner: Proc, kills: list[Kill], t0: float, log,
                      timeout_s: float = 420.0) -> None:
    """Issue 50 item 3: one valid but huge group (4 frames of 224 x 224, under ``learner.max_group_pixels``) and
    one over the learner's limits (280 x 280) enter the stream, from a producer that keeps an audit log. The
    second is dead-lettered ``too_large`` at once. The first is trained, and the learner is crashed (SIGSEGV, as a
    decoder that segfaults on it would; a kill -9 from outside is not the group's doing and counts nothing) each
    time a step holds it and restarted with --resume, until a start dead-letters it as ``crash_loop`` (after
    ``learner.crash_loop_starts`` deaths). Each kill is a ``huge-group`` :class:`Kill`;
    its note says how it ended."""
    import dataclasses

    from benchmarks.rollouts import sample_groups
    from streamgrpo.transport.queue.crash_marks import CrashMarks
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    def sample(side: int, seed: int):
        over = [f"data.min_pixels={side * side}", f"data.max_pixels={side * side}", "data.kinds=[colour]"]  # 1 video
        return sample_groups(cfg.model.name_or_path, cfg.data.train_path, 1, data_overrides=over, seed=seed,
                             num_generations=cfg.rollout.num_generations, max_tokens=cfg.rollout.max_completion_length)[0]

    version = _last_step(run_dir)  # fresh enough to be trained, not dropped as stale
    huge, over = (dataclasses.replace(sample(side, 90 + i), policy_version=version, generator_id="chaos-huge")
                  for i, side in enumerate((HUGE_SIDE, TOO_LARGE_SIDE)))
    with open(run_dir / "audit" / "chaos-huge.jsonl", "a") as fh:
        for g in (huge, over):
            fh.write(json.dumps({"event": "produced", "group_id": g.group_id}) + "\n")
    q = RedisQueue(url, namespace=cfg.queue.namespace, consumer="chaos-huge")
    marks = CrashMarks(q.client, cfg.queue.namespace, "learner-0")
    try:
        q.put_many([huge, over])
        log(f"[{time.monotonic() - t0:6.1f}s] huge groups in: {huge.group_id} (4 x {HUGE_SIDE}^2 pixels), "
            f"{over.group_id} (4 x {TOO_LARGE_SIDE}^2, over learner.max_group_pixels)")
        deadline, cleared, dead, stale, look = time.monotonic() + timeout_s, False, {}, 0, 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= look:  # the dead letters and the learner's drops: once a second
                look = time.monotonic() + 1.0
                dead = {d["group_id"]: d["reason"].split(":")[0] for d in q.dead_letters(100)}
                if dead.get(huge.group_id) and dead.get(over.group_id):
                    break
                if _stale_drops(run_dir, huge.group_id) > stale:  # released: the learner moved on while it was held
                    stale += 1  # in again, fresh; its count of deaths stays in Redis under its id
                    q.put(dataclasses.replace(huge, policy_version=_last_step(run_dir)))
                    log(f"[{time.monotonic() - t0:6.1f}s] the huge group was dropped as stale; sent again")
            if learner.p.poll() is not None:
                learner.start()
                cleared = False
            mark = marks.read([marks.consumer])[0].groups
            cleared |= huge.group_id not in mark  # a killed learner's mark stays until the next start counts it
            if cleared and huge.group_id in mark:
                learner.kill9(signal.SIGSEGV)
                kills.append(Kill(round(time.monotonic() - t0, 1), "huge-group", _last_step(run_dir)))
                log(f"[{kills[-1].at_s:6.1f}s] SIGSEGV to the learner in a step holding the huge group "
                    f"(learner at step {kills[-1].step})")
                learner.start()
                cleared = False
            time.sleep(0.02)
        note = f"{huge.group_id}: {dead.get(huge.group_id, 'not dead-lettered')}, " \
               f"{over.group_id}: {dead.get(over.group_id, 'not dead-lettered')}"
        log(f"[{time.monotonic() - t0:6.1f}s] huge-group phase: {note}")
        for k in kills:
            if k.target == "huge-group":
                k.note = note
    finally:
        q.close()


def run_chaos(run_dir: Path, *, duration_s: float, learner_kills: int, generators: int = 2, seed: int = 0,
              model: str | None = None, data: str | None = None, sets: tuple[str, ...] = (),
              log=print, up_s: float = 0.0, maxmemory_s: float = 0.0) -> tuple[object, list[Kill], dict]:
    """Run the soak; returns (the audit, the kills done, what the run looked like)."""
    from streamgrpo.config import load_config
    from streamgrpo.recipes.demo.assets import prepare_assets
    from streamgrpo.runtime.processes import free_port
    from streamgrpo.transport.queue.redis_stream import RedisQueue
    from streamgrpo.transport.queue.server import EmbeddedRedis

    run_dir.mkdir(parents=True, exist_ok=True)
    redis = EmbeddedRedis(run_dir / "redis", appendfsync="always")
    url = redis.start()
    overrides = [f"run_dir={run_dir}", f"queue.url={url}", "learner.max_steps=1000000", "learner.save_steps=5",
                 "learner.get_timeout_s=1", f"rollout.num_generators={generators}", "metrics.port=0",
                 f"weights.pub_port={free_port()}", f"weights.snapshot_port={free_port()}", f"seed={seed}",
                 "eval.enabled=false", "launch.agreement_check=false",  # each `up --resume` restarts at once
                 f"learner.max_group_pixels={HUGE_LIMIT}"]  # the huge-group phase: one group taken, one not
    if model:
        overrides += [f"model.name_or_path={model}", "demo.tiny_model=false"]
    if data:
        overrides += [f"data.train_path={data}", "demo.make_data=false"]
    cfg = load_config("demo", [*overrides, *sets])
    prepare_assets(cfg)
    cfg_path = run_dir / "chaos-config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    (run_dir / "logs").mkdir(exist_ok=True)
    base = [sys.executable, "-m", "streamgrpo"]
    learner = Proc("learner", [*base, "learner", "--config", str(cfg_path), "--fresh"], run_dir / "logs" / "learner.log")
    learner.argv = [*base, "learner", "--config", str(cfg_path), "--resume"]  # every restart resumes
    gens = {f"generator-{k}": Proc(f"generator-{k}", [*base, "generator", "--config", str(cfg_path), "--id", str(k)],
                                   run_dir / "logs" / f"generator-{k}.log") for k in range(generators)}
    plan = make_plan(duration_s, learner_kills, generators, seed)
    kills: list[Kill] = []
    t0 = time.monotonic()
    try:
        pending = list(plan.kills)
        while time.monotonic() - t0 < duration_s:
            now = time.monotonic() - t0
            for proc in [learner, *gens.values()]:  # a process that died on its own is restarted too
                if proc.p.poll() is not None:
                    log(f"[{now:6.1f}s] {proc.name} exited by itself (code {proc.p.returncode}); restarting")
                    proc.start()
            if pending and now >= pending[0][0]:
                _, target = pending.pop(0)
                if target.startswith("learner") and time.monotonic() - learner.started < 15.0:
                    pending.insert(0, (now + 5.0, target))  # let a fresh learner load and train first
                    continue
                kills.append(Kill(round(now, 1), target, _last_step(run_dir)))
                log(f"[{now:6.1f}s] kill -9 {target} (learner at step {kills[-1].step})")
                if target == "redis":
                    redis.kill()
                    time.sleep(1.0)
                    redis.start()
                elif target == "learner-ckpt":
                    kills[-1].note = _kill_while_checkpointing(learner, run_dir)
                    log(f"  {kills[-1].note}")
                    learner.start()
                else:
                    proc = learner if target == "learner" else gens[target]
                    proc.kill9()
                    proc.start()
            time.sleep(0.5)
        _huge_group_phase(run_dir, cfg, url, learner, kills, t0, log)
        if maxmemory_s > 0:
            _maxmemory_phase(url, run_dir, [learner, *gens.values()], maxmemory_s, kills, t0, log)
        log(f"[{time.monotonic() - t0:6.1f}s] stopping: generators, then the learner (final checkpoint)")
        for g in gens.values():
            g.term()
        code = learner.term()
        if code not in (0, None):
            log(f"the learner's clean stop exited with {code}; see {learner.log}")
        if up_s > 0:
            _up_phase(run_dir, cfg_path, generators, up_s, kills, t0, log)
        from benchmarks.audit import audit_run

        queue = RedisQueue(url, namespace=cfg.queue.namespace, consumer="chaos-audit")
        try:
            result = audit_run(run_dir, queue)
        finally:
            queue.close()
    finally:
        for p in [*gens.values(), learner]:
            p.kill9()
        redis.stop()
    info = {"seconds": round(time.monotonic() - t0, 1), "learner_stop_code": code}
    return result, kills, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--learner-kills", type=int, default=10)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--up-minutes", type=float, default=3.0,
                    help="then go on under `up --resume`: kill -9 it, SIGHUP it (0: skip)")
    ap.add_argument("--maxmemory-minutes", type=float, default=1.0,
                    help="then Redis maxmemory under what it uses for this long, then restored (0: skip)")
    ap.add_argument("--run-dir", default=str(ROOT / "benchmarks" / ".work" / "chaos"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override for every process")
    args = ap.parse_args(argv)
    import shutil

    run_dir = Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    result, kills, info = run_chaos(run_dir, duration_s=args.minutes * 60, learner_kills=args.learner_kills,
                                    generators=args.generators, seed=args.seed, sets=tuple(args.sets),
                                    up_s=args.up_minutes * 60, maxmemory_s=args.maxmemory_minutes * 60)
    by = {t: sum(k.target.startswith(t) for k in kills) for t in ("learner", "generator", "redis")}
    up = {t: sum(k.target == t for k in kills) for t in ("up", "up-hup")}
    ckpt = next((k.note for k in kills if k.target == "learner-ckpt"), "none")
    huge = [k.note for k in kills if k.target == "huge-group"]
    print(f"kills: learner {by['learner']} (one {ckpt}), generator {by['generator']}, redis {by['redis']}, "
          f"up kill -9 {up['up']}, up SIGHUP {up['up-hup']} in {info['seconds']:.0f}s; resumes {result.resumes}")
    print(f"huge groups: learner killed -9 {len(huge)} times in a step holding one; {huge[-1] if huge else 'none'}")
    print(f"steps {result.steps} (in order: {result.steps_in_order}), final version {result.version}; "
          f"groups produced {result.produced}, trained {result.trained}, dropped {result.dropped}, "
          f"still queued {result.queued}, uncommitted {result.uncommitted}")
    for k in kills:
        if k.target == "redis-maxmemory":
            print(f"redis at maxmemory: {k.note}")
    if result.lost_ids or result.twice_ids:
        print(f"lost ids (first 20): {result.lost_ids}; twice: {result.twice_ids}")
    print(result.line())
    out = ROOT / "benchmarks" / "results" / "chaos.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "chaos", "args": vars(args), "info": info, "kills": [asdict(k) for k in kills],
                               "audit": asdict(result), "ok": result.ok}, indent=1))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
