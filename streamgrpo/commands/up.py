"""``streamgrpo up``: everything on one machine.

Plans where each process runs (:mod:`.placement`: learner ranks and generators on the node's GPUs,
or the CPU) and prints the plan; starts an embedded Redis when no ``queue.url`` is set, the learner
(under ``python -m torch.distributed.run`` for several ranks), N generators and with ``eval.enabled``
the evaluator as child processes (each with its own devices, /metrics port and log file in the run
directory), shows one live status line, stops at ``learner.max_steps``, and on exit or Ctrl-C stops
every child by PID and waits for it. With ``--resume`` the generators go on where the learner's committed data
cursor says each shard got (:mod:`streamgrpo.data.cursor`); a new run starts them at the beginning. Writes ``config.yaml``, ``metrics.jsonl`` (by the learner),
``eval.jsonl`` (by the evaluator), ``summary.json``, ``reward.png`` and ``eval.png`` into the run
directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamgrpo.commands.args import load
from streamgrpo.commands.checks import prepare_recipes
from streamgrpo.commands.placement import generator_gib, parse_gpus, plan_placement
from streamgrpo.config import Config
from streamgrpo.config.roles import final_version
from streamgrpo.models.model_config import ModelConfigUnavailable
from streamgrpo.runtime.accuracy import TARGET_ACCURACY, WINDOW_GROUPS, group_accuracies, target_reached
from streamgrpo.runtime.jsonl import read_new_lines, write_json
from streamgrpo.runtime.processes import die_with_parent, free_port, stop_processes
from streamgrpo.runtime.run_dir import LEARNER_OUTPUTS, RunLock, archive_previous
from streamgrpo.transport.queue.factory import open_queue
from streamgrpo.transport.queue.server import EmbeddedRedis

log = logging.getLogger("streamgrpo.up")

AGREEMENT_REFUSED_EXIT = 1  # launch.agreement_check found the generators and the learner disagree

FINAL_EVAL_WAIT_S = 300.0
"""How long `up` waits, after the learner's last step, for the evaluator's result at that version."""


CHILD_GRACE_S = 20.0
"""How long a child may take to stop after SIGTERM before `up` kills it."""


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_path
        self._fh = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=die_with_parent)  # gone with `up`
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = CHILD_GRACE_S) -> int | None:
        """SIGTERM (finish the current unit of work), then SIGKILL after ``grace_s``; by PID only."""
        return stop_children([self], grace_s)[0]


def stop_children(children: list[Child], grace_s: float = CHILD_GRACE_S) -> list[int | None]:
    """SIGTERM by PID, SIGKILL after ``grace_s``: the generators (and the evaluator) first, side by side, so
    `up` waits for the slowest of them rather than for each in turn; then the learner (``children[0]``),
    which finishes its step and checkpoints. Stopped while the learner still reads, a generator blocked
    on a full queue gets its room at once (it would wait out its grace with the learner gone)."""
    learner, others = children[:1], children[1:]
    try:
        codes = stop_processes([c.proc for c in others], grace_s) + stop_processes([c.proc for c in learner], grace_s)
    finally:
        for c in children:
            c._fh.close()
    return codes[len(others):] + codes[:len(others)]


def summarise(rows: list[dict[str, Any]], started: float, finished: float) -> dict[str, Any]:
    """summary.json: steps, groups, accuracy over the first/last 50 trained groups, time to 0.9."""
    accs = [a for _, _, a in group_accuracies(rows)]
    first, last = accs[:WINDOW_GROUPS], accs[-WINDOW_GROUPS:]
    hit = target_reached(rows)
    time_to_target = None if hit is None else round(hit[1] - started, 2)
    final = rows[-1] if rows else {}
    return {
        "steps": final.get("step", 0),
        "version": final.get("version", 0),
        "groups_trained": final.get("groups_trained", 0),
        "groups_dropped": final.get("groups_dropped", {}),
        "wall_seconds": round(finished - started, 2),
        "first_accuracy": sum(first) / len(first) if first else None,
        "last_accuracy": sum(last) / len(last) if last else None,
        "time_to_target_s": time_to_target,
        "target_accuracy": TARGET_ACCURACY,
        "final_reward": final.get("reward"),
    }


def best_eval(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The best held-out accuracy of ``eval.jsonl`` lines and its version (pure); None when there is none."""
    scored = [(line["accuracy"], line.get("version")) for line in lines if isinstance(line.get("accuracy"), (int, float))]
    if not scored:
        return {"best_eval_accuracy": None, "best_eval_version": None}
    acc, version = max(scored, key=lambda x: (x[0], -(x[1] or 0)))  # the earliest version reaching the best
    return {"best_eval_accuracy": acc, "best_eval_version": version}


def plot_rewards(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward"] for r in rows], label="reward (total)", color="tab:blue")
    fns = sorted({k for r in rows for k in (r.get("rewards") or {})})
    for fn in fns:
        if fn != "accuracy":
            ax.plot(steps, [(r.get("rewards") or {}).get(fn) for r in rows], label=f"reward: {fn}", alpha=0.6)
    if any(r.get("accuracy") is not None for r in rows):
        ax.plot(steps, [r.get("accuracy") for r in rows], label="accuracy", color="tab:green")
    ax.axhline(TARGET_ACCURACY, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean over the step's groups")
    ax.set_ylim(-0.05, max(1.05, max((r["reward"] for r in rows), default=1.0) + 0.05))
    ax.legend(loc="lower right")
    ax.set_title("streamgrpo: reward and accuracy over training")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _status_line(rows: list[dict[str, Any]], depth: int | None, started: float, alive: str,
                 evals: list[dict[str, Any]] | None = None) -> str:
    r = rows[-1] if rows else {}
    e = evals[-1] if evals else None
    held_out = "" if e is None else (f"eval {'-' if e.get('accuracy') is None else format(e['accuracy'], '.3f')}"
                                     f"@v{e.get('version')}  ")
    elapsed = time.time() - started
    gps = r.get("groups_trained", 0) / elapsed if elapsed > 0 else 0.0
    acc, mfu = r.get("accuracy"), r.get("mfu")
    return (f"[{elapsed:6.0f}s] step {r.get('step', 0):4d}  v{r.get('version', 0):<4d} "
            f"reward {r.get('reward', float('nan')):.3f}  acc {'-' if acc is None else f'{acc:.3f}'}  "
            f"stale {r.get('staleness_mean', 0.0):.1f}  queue {'-' if depth is None else depth:>3}  "
            f"{gps:.2f} groups/s  {r.get('tokens_per_second', 0.0):.0f} tok/s  "
            f"{held_out}{'' if mfu is None else f'MFU {100 * mfu:.1f}%  '}{alive}")


def run_up(cfg: Config, *, generators: int | None = None, run_dir: str | None = None, sync: bool = False,
           config_source: str | None = None, status_every_s: float = 1.0, resume: bool = False,
           learner_ranks: int | None = None, gpus: str | None = None, generators_per_gpu: int | None = None,
           colocate: bool | None = None, plan_only: bool = False, gpu_gib: float | None = None) -> int:
    _apply_options(cfg, generators=generators, run_dir=run_dir, sync=sync, resume=resume)
    _apply_launch(cfg, learner_ranks=learner_ranks, gpus=gpus, generators_per_gpu=generators_per_gpu,
                  colocate=colocate)
    plan = placement_for(cfg, gpu_gib)
    for line in plan.lines():
        print(line, flush=True)
    if plan_only:
        return 0
    owner = RunLock(cfg.run_dir, "up", "`streamgrpo up`")  # one `up` per run directory
    rd = _prepare_run_dir(cfg)
    env = _child_env(cfg)
    redis = _start_embedded_redis(cfg, rd, env)
    _new_run_data_cursor(cfg)
    config_path = _write_child_config(cfg, rd, env)
    refusal = _agreement_check(cfg, rd, config_path, env, plan)
    if refusal is not None:
        print(refusal, file=sys.stderr, flush=True)
        if redis is not None:
            redis.stop()
        owner.close()
        return AGREEMENT_REFUSED_EXIT
    watch = _Watch(cfg, env, rd / "metrics.jsonl")
    children: list[Child] = []
    code, interrupted = 0, False
    previous = _interrupt_on_signals()
    try:
        children = _start_children(cfg, rd, config_path, env, plan)
        code = watch.until_done(children, status_every_s)
        if code == 0:
            watch.await_final_eval(children)
    except KeyboardInterrupt as exc:
        interrupted = True
        name = str(exc) or "SIGINT"
        code = 128 + int(getattr(signal, name, signal.SIGINT))
        print(f"\n{'Ctrl-C' if name == 'SIGINT' else name}: stopping every process ...", flush=True)
    finally:
        for sig in previous:  # the stopping below is not interrupted (Child.stop escalates to SIGKILL itself)
            signal.signal(sig, signal.SIG_IGN)
        # a generator may wait rollout.stop_grace_s for room to deliver its last batch: not cut short by SIGKILL
        stop_children(children, max(CHILD_GRACE_S, cfg.rollout.stop_grace_s + 10.0))
        watch.close()
        if redis is not None:
            redis.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _finish(rd, watch, interrupted)
    owner.close()
    return code


def _apply_options(cfg: Config, *, generators: int | None, run_dir: str | None, sync: bool, resume: bool) -> None:
    """The command line's choices, into the config every child reads."""
    if resume:
        cfg.learner.resume, cfg.learner.fresh = True, False
    if run_dir:
        cfg.run_dir = run_dir
    if generators is not None:
        cfg.rollout.num_generators = generators
    if sync:
        cfg.rollout.sync = True
        cfg.learner.max_staleness = 0  # what the config's own check implies for the children that load it


def _apply_launch(cfg: Config, *, learner_ranks: int | None, gpus: str | None, generators_per_gpu: int | None,
                  colocate: bool | None) -> None:
    """The placement flags, into ``cfg.launch``; several learner ranks need the deepspeed backend."""

    if gpus is not None:
        parse_gpus(gpus)  # a malformed --gpus is a one-line PlacementError, not a validation dump
        cfg.launch.gpus = gpus
    if learner_ranks is not None:
        cfg.launch.learner_ranks = learner_ranks
    if generators_per_gpu is not None:
        cfg.launch.generators_per_gpu = generators_per_gpu
    if colocate is not None:
        cfg.launch.colocate = colocate
    if cfg.launch.learner_ranks > 1 and cfg.learner.backend == "torch":
        cfg.learner.backend = "deepspeed"
        print(f"{cfg.launch.learner_ranks} learner ranks: learner.backend set to deepspeed (ZeRO-2 unless "
              "learner.deepspeed_config says otherwise)", flush=True)


def visible_gpus(env: dict[str, str] | None = None) -> tuple[int, ...]:
    """The CUDA devices this process sees (indices), without initialising CUDA when none is visible."""
    import shutil

    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return ()
    if not Path("/proc/driver/nvidia").exists() and not shutil.which("nvidia-smi"):
        return ()  # no NVIDIA driver: no need to import torch to know
    try:
        import torch
    except ImportError:
        return ()
    return tuple(range(torch.cuda.device_count())) if torch.cuda.is_available() else ()


def placement_for(cfg: Config, gpu_gib: float | None = None):
    """The placement plan of ``cfg`` on this machine: its devices (``launch.gpus`` or every visible one),
    their memory (``gpu_gib``: say it, e.g. to plan a GPU node from elsewhere), the learner rank's
    plan (static parts and a step's) and a generator's (when the model's config.json can be read; when not, one
    warning says which file the plan needs and how to get it)."""

    lc = cfg.launch
    devices = parse_gpus(lc.gpus)
    if devices is None:
        devices = visible_gpus()
    shape = dict(devices=devices, learner_ranks=lc.learner_ranks, generators=cfg.rollout.num_generators,
                 generators_per_gpu=lc.generators_per_gpu, colocate=lc.colocate, evaluator=cfg.eval.enabled)
    plan = plan_placement(**shape)  # what can never work is said before any model config is read
    if not devices:
        return plan
    import torch

    device_gib, learner_gib = gpu_gib, None
    if device_gib is None and torch.cuda.is_available() and max(devices) < torch.cuda.device_count():
        device_gib = min(torch.cuda.get_device_properties(d).total_memory for d in devices) / (1 << 30)
    params, gen_step_gib, notes = None, 0.0, []

    try:  # a Hub id's config.json: from the cache, else one try at the Hub
        from streamgrpo.learner.memory.plan import plan_for
        from streamgrpo.learner.memory.step import generator_step_bytes
        from streamgrpo.models.params import model_shape

        counts, _, mem = plan_for(cfg, world_size=lc.learner_ranks)
        learner_gib, params = mem.device_bytes / (1 << 30), counts.total
        gen_step_gib = generator_step_bytes(cfg, model_shape(cfg)) / (1 << 30)
        notes.append(f"learner per rank: {mem.describe()}")
        if cfg.rollout.engine == "hf":
            notes.append(f"a generator (hf engine): its weights + kv cache, prefill and logits {gen_step_gib:.1f} GiB")
    except ModelConfigUnavailable as exc:  # the plan is printed without memory figures, and says why
        log.warning("placement: no memory figures: %s", exc)
    except Exception as exc:  # noqa: BLE001 - the plan is printed without memory figures then
        log.warning("placement: no memory figures (%s: %s)", type(exc).__name__, str(exc).splitlines()[0])
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]
    gen_gib = generator_gib(cfg.rollout.engine, params=params, dtype_bytes=dtype_bytes,
                            gpu_memory_utilization=cfg.rollout.vllm.gpu_memory_utilization, device_gib=device_gib,
                            step_gib=gen_step_gib)
    eval_gib = generator_gib(cfg.eval.engine, params=params, dtype_bytes=dtype_bytes,  # hf: its weights
                             gpu_memory_utilization=cfg.rollout.vllm.gpu_memory_utilization, device_gib=device_gib)
    vllm_share = cfg.rollout.vllm.gpu_memory_utilization if cfg.rollout.engine == "vllm" else None
    plan = plan_placement(**shape, learner_gib=learner_gib, generator_gib=gen_gib, device_gib=device_gib,
                          evaluator_gib=eval_gib, vllm_utilization=vllm_share)
    return dataclasses.replace(plan, notes=plan.notes + tuple(notes))


def up_outputs(cfg: Config) -> list[str]:
    """What a `streamgrpo up` run leaves in its run directory (globs): moved aside before a new run."""
    return [*LEARNER_OUTPUTS, "audit", "summary.json", "reward.png", "eval.jsonl", "eval.png"] + \
        ([] if cfg.queue.url else ["redis", "redis.json"])


def _prepare_run_dir(cfg: Config) -> Path:
    """The run directory, the recipes' assets (the demo's data and tiny model), and (a new run) the previous run's outputs moved aside."""
    rd = Path(cfg.run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "logs").mkdir(exist_ok=True)
    prepare_recipes(cfg, model=True, say=lambda line: print(line, flush=True))
    if not cfg.learner.resume:  # a new run: the previous one's outputs (and embedded queue) move to previous/<time>/
        moved = archive_previous(rd, up_outputs(cfg))
        if moved is not None:
            print(f"the previous run in {rd} moved to {moved} (--resume continues a run instead)", flush=True)
    return rd


def _child_env(cfg: Config) -> dict[str, str]:
    """The children's environment: one torch thread each, and Hub offline mode only for a local model
    (a Hub id must be able to download; ``HF_HUB_OFFLINE`` set by the user is kept either way)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if Path(cfg.model.name_or_path).expanduser().exists():
        env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _start_embedded_redis(cfg: Config, rd: Path, env: dict[str, str]):
    """An embedded redis-server in ``<run_dir>/redis`` when no ``queue.url`` is set (its URL goes to the children)."""
    if cfg.queue.url:
        return None

    redis = EmbeddedRedis(rd / "redis", die_with_parent=True)
    url = redis.start()
    write_json(rd / "redis.json", {"url": url, "pid": redis.pid})
    env["STREAMGRPO_REDIS_URL"] = url
    print(f"embedded Redis at {url} (AOF in {rd / 'redis'})", flush=True)
    return redis


def _new_run_data_cursor(cfg: Config) -> None:
    """A new run on a ``queue.url`` Redis (an embedded one is new with the run): the data cursor an earlier
    run in this namespace committed is cleared before any generator starts, so none of them continues the
    earlier run's shards (the learner clears it too at step 0, but maybe after a generator has read it).
    ``--resume`` keeps it: the generators continue where the learner's checkpoints say."""
    if cfg.learner.resume or not cfg.queue.url:
        return

    with open_queue(cfg.queue, consumer="up") as queue:
        queue.reset_committed_step()


def _write_child_config(cfg: Config, rd: Path, env: dict[str, str]) -> Path:
    """``<run_dir>/config.yaml`` for the children: weight ports fixed, and no secret on disk (a
    ``queue.url`` travels in the children's environment, ``STREAMGRPO_REDIS_URL``, instead)."""
    if cfg.weights.pub_port == 0:
        cfg.weights.pub_port = free_port()
    if cfg.weights.snapshot_port == 0:
        cfg.weights.snapshot_port = free_port()
    on_disk = cfg.model_copy(deep=True)
    if cfg.queue.url:
        env["STREAMGRPO_REDIS_URL"] = cfg.queue.url
        on_disk.queue.url = None
    path = rd / "config.yaml"
    path.write_text(on_disk.to_yaml())
    return path


@dataclass(frozen=True)
class ChildSpec:
    """How ``up`` starts one process: its command line and what it changes in the environment."""

    name: str
    argv: list[str]
    env: dict[str, str]
    metrics_port: int  # 0: a free one, written to <run_dir>/ports/ by the process


def child_specs(cfg: Config, plan, config_path: Path, python: str = sys.executable,
                visible_ids: list[str] | None = None) -> list[ChildSpec]:
    """The learner's and the generators' commands for ``plan`` (pure): torchrun for several learner
    ranks, each process's ``CUDA_VISIBLE_DEVICES`` (``visible_ids``: what this process's device
    indices are called, from its own ``CUDA_VISIBLE_DEVICES``), and with a fixed ``metrics.port`` P
    one port each (learner rank r: P + r; generator k: P + ranks + k)."""
    def devices(p) -> str:
        return ",".join(visible_ids[d] if visible_ids else str(d) for d in p.devices)

    base, learner = [python, "-m", "streamgrpo"], plan.learner
    head = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(learner.ranks), "-m",
            "streamgrpo"] if learner.ranks > 1 else base
    port = cfg.metrics.port
    specs = [ChildSpec("learner", [*head, "learner", "--config", str(config_path)],
                       {"CUDA_VISIBLE_DEVICES": devices(learner)}, port)]
    for k, g in enumerate(plan.generators):
        gport = port + learner.ranks + k if port else 0
        extra = ["--set", f"metrics.port={gport}"] if port else []
        specs.append(ChildSpec(g.name, [*base, "generator", "--config", str(config_path), "--id", str(k), *extra],
                               {"CUDA_VISIBLE_DEVICES": devices(g)}, gport))
    if plan.evaluator is not None:
        eport = port + learner.ranks + len(plan.generators) if port else 0
        extra = ["--set", f"metrics.port={eport}"] if port else []
        specs.append(ChildSpec("evaluator", [*base, "evaluator", "--config", str(config_path), *extra],
                               {"CUDA_VISIBLE_DEVICES": devices(plan.evaluator)}, eport))
    return specs


def _agreement_check(cfg: Config, rd: Path, config_path: Path, env: dict[str, str], plan) -> str | None:
    """``launch.agreement_check``: ``streamgrpo check agreement`` on one group, in a process of its own on the
    learner's devices (its two models are gone before the run starts). None when the roles agree (or the
    check is off), else the one line that refuses the run."""
    if not cfg.launch.agreement_check:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    learner = child_specs(cfg, plan, config_path, visible_ids=visible.split(",") if visible else None)[0]
    out, log_path = rd / "agreement.json", rd / "logs" / "agreement.log"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "streamgrpo", "check", "agreement", "--config", str(config_path), "--groups", "1",
            "--max-tokens", "16", "--out", str(out)]
    print("checking that the generators and the learner compute the same policy (launch.agreement_check) ...",
          flush=True)
    with open(log_path, "ab") as fh:
        code = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env={**env, **learner.env},
                              preexec_fn=die_with_parent).returncode
    verdict = json.loads(out.read_text()) if out.is_file() else None
    skip = "launch.agreement_check=false skips this check"
    if verdict is None:
        return f"refusing to train: the agreement check failed (exit {code}), see {log_path} ({skip})"
    if not verdict["agree"]:
        return f"refusing to train: {verdict['line']} (details in {log_path}; {skip})"
    print(verdict["line"], flush=True)
    return None


def _start_children(cfg: Config, rd: Path, config_path: Path, env: dict[str, str], plan) -> list[Child]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",")] if visible else None
    children = [Child(s.name, s.argv, rd / "logs" / f"{s.name}.log", {**env, **s.env})
                for s in child_specs(cfg, plan, config_path, visible_ids=ids)]
    write_json(rd / "processes.json", {c.name: c.pid for c in children})
    ranks = f" ({plan.learner.ranks} ranks)" if plan.learner.ranks > 1 else ""
    evaluator = " + the evaluator" if plan.evaluator is not None else ""
    print(f"learner{ranks} + {cfg.rollout.num_generators} generators{evaluator} started; logs in {rd / 'logs'}",
          flush=True)
    for line in cfg.advice():
        print(f"note: {line}", flush=True)
    return children


class _Watch:
    """The live status line: follows ``metrics.jsonl`` and the queue depth until the learner ends."""

    def __init__(self, cfg: Config, env: dict[str, str], metrics_path: Path):
        self.cfg, self.env, self.metrics_path = cfg, env, metrics_path
        self.eval_path = metrics_path.with_name("eval.jsonl")
        self.ranks = cfg.launch.learner_ranks
        self.rows: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.offset = self.eval_offset = 0
        self.queue = None
        self.started = time.time()
        self.finished: float | None = None

    def read(self) -> None:
        self.offset = read_new_lines(self.metrics_path, self.offset, self.rows)
        self.eval_offset = read_new_lines(self.eval_path, self.eval_offset, self.evals)

    def until_done(self, children: list[Child], status_every_s: float) -> int:
        """Show the status until the learner exits (its code) or every generator has (0); an evaluator
        that exits is reported and training goes on."""
        learner, others = children[0], children[1:]
        gens = [c for c in others if c.name != "evaluator"]
        tty, last_print, reported = sys.stdout.isatty(), 0.0, set()
        while True:
            self.read()
            if self.queue is None:
                self.queue = _try_queue(self.cfg, self.env)
            alive = sum(c.alive() for c in gens)
            line = _status_line(self.rows, _depth(self.queue), self.started,
                                f"{self.ranks} learner ranks, gens {alive}/{len(gens)}" if self.ranks > 1
                                else f"gens {alive}/{len(gens)}", self.evals)
            if tty:
                sys.stdout.write("\r" + line[: os.get_terminal_size().columns - 1])
                sys.stdout.flush()
            elif time.time() - last_print >= 10.0:
                print(line, flush=True)
                last_print = time.time()
            for c in others:
                if not c.alive() and c.name not in reported:
                    reported.add(c.name)
                    print(f"\n{c.name} exited with code {c.proc.returncode}; see {c.log_path}", flush=True)
            if not learner.alive():
                code = learner.proc.returncode or 0
                if code != 0:
                    print(f"\nthe learner exited with code {code}; see {learner.log_path}", flush=True)
                return code
            if alive == 0 and gens:
                print("\nall generators have exited; stopping the learner", flush=True)
                return 0
            try:  # the next status, or the learner's exit at once (its last step ends the run)
                learner.proc.wait(timeout=status_every_s)
            except subprocess.TimeoutExpired:
                pass

    def await_final_eval(self, children: list[Child], timeout_s: float = FINAL_EVAL_WAIT_S) -> None:
        """After the learner's last step: wait (at most ``timeout_s``) for the evaluator's result at the
        final version, which it evaluates whatever ``eval.every_versions`` says."""
        evaluator = next((c for c in children if c.name == "evaluator"), None)
        self.read()
        if evaluator is None or not evaluator.alive() or not self.rows:
            return

        final = final_version(self.cfg)
        if self.rows[-1].get("step", 0) < self.cfg.learner.max_steps or final <= 0:
            return  # the learner stopped early: there is no final version to wait for
        print(f"\nwaiting for the evaluator's result at v{final} (at most {timeout_s:.0f} s) ...", flush=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline and evaluator.alive():
            self.read()
            if any((e.get("version") or -1) >= final for e in self.evals):
                return
            time.sleep(0.5)
        print(f"no evaluator result at v{final}; see {evaluator.log_path}", flush=True)

    def close(self) -> None:
        self.finished = time.time()
        if self.queue is not None:
            self.queue.close()


def _finish(rd: Path, watch: _Watch, interrupted: bool) -> None:
    """summary.json, reward.png and the closing lines."""
    watch.read()
    summary = summarise(watch.rows, watch.started, watch.finished or time.time())
    summary["interrupted"] = interrupted
    if watch.evals:
        summary.update(best_eval(watch.evals))
    write_json(rd / "summary.json", summary)
    outputs = [rd / "config.yaml", watch.metrics_path, rd / "summary.json"]
    if watch.rows:
        outputs.append(plot_rewards(watch.rows, rd / "reward.png"))
    if watch.evals:
        from streamgrpo.commands.report import plot_eval

        outputs += [p for p in (watch.eval_path, plot_eval(watch.evals, rd / "eval.png")) if p is not None]
    keys = ("steps", "groups_trained", "first_accuracy", "last_accuracy", "time_to_target_s", "wall_seconds",
            *(("best_eval_accuracy", "best_eval_version") if watch.evals else ()))
    print("\n" + json.dumps({k: summary[k] for k in keys}), flush=True)
    for p in outputs:
        print(f"  {p}")


def _interrupt_on_signals() -> dict[int, Any]:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP (a closed terminal) raise KeyboardInterrupt (its message: the
    signal's name) in ``up``, so each stops every child by PID, also when ``up`` was started where
    SIGINT is ignored (a background job of a script). SIGKILL cannot be caught: the children die with
    ``up`` then through ``PR_SET_PDEATHSIG`` (:func:`~streamgrpo.runtime.processes.die_with_parent`). Returns the
    previous handlers; {} off the main thread."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def _try_queue(cfg: Config, env: dict[str, str]):
    try:
        from streamgrpo.transport.queue.factory import open_queue

        url = cfg.queue.url or env.get("STREAMGRPO_REDIS_URL")
        return open_queue(cfg.queue, url, consumer="up-status") if url else None
    except Exception:  # noqa: BLE001 - the status line simply shows no depth
        return None


def _depth(queue) -> int | None:
    if queue is None:
        return None
    try:
        return queue.depth()
    except Exception:  # noqa: BLE001
        return None


def main(args) -> int:
    return run_up(load(args), generators=args.generators, run_dir=args.run_dir, sync=args.sync,
                  config_source=args.config, resume=args.resume, learner_ranks=args.learner_ranks, gpus=args.gpus,
                  generators_per_gpu=args.generators_per_gpu, colocate=args.colocate, plan_only=args.plan,
                  gpu_gib=args.gpu_gib)
