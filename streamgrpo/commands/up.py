"""``streamgrpo up``: everything on one machine.

Plans where each process runs (:mod:`.placement`: learner ranks and generators on the node's GPUs,
or the CPU) and prints the plan; starts an embedded Redis when no ``queue.url`` is set, the learner
(under torchrun for several ranks: ``python -m streamgrpo.learner.ranks``), N generators and with ``eval.enabled``
the evaluator as child processes (each with its own devices, /metrics port and log file in the run
directory), shows one live status line, stops at ``learner.max_steps``, and on exit or Ctrl-C stops
every child by PID and waits for it. With ``--resume`` the generators go on where the learner's committed data
cursor says each shard got (:mod:`streamgrpo.data.cursor`); a new run starts them at the beginning. Writes ``config.yaml``, ``metrics.jsonl`` (by the learner),
``eval.jsonl`` (by the evaluator), ``summary.json``, ``reward.png`` and ``eval.png`` into the run
directory.

The processes' commands, start and stop: :mod:`.up_children`; the status line and the summary: :mod:`.up_watch`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from streamgrpo.commands.checks import prepare_recipes
from streamgrpo.commands.placement import generator_gib, parse_gpus, plan_placement
from streamgrpo.commands.up_children import CHILD_GRACE_S, Child, child_specs, start_children, stop_children
from streamgrpo.commands.up_watch import Watch, finish_run
from streamgrpo.config import Config, load_config
from streamgrpo.config.launch import backend_for_ranks
from streamgrpo.models.model_config import ModelConfigUnavailable
from streamgrpo.runtime.jsonl import write_json
from streamgrpo.runtime.processes import die_with_parent, free_port
from streamgrpo.runtime.run_dir import LEARNER_OUTPUTS, RunLock, archive_previous
from streamgrpo.transport.queue.factory import open_queue
from streamgrpo.transport.queue.server import EmbeddedRedis

log = logging.getLogger("streamgrpo.up")

AGREEMENT_REFUSED_EXIT = 1  # launch.agreement_check found the generators and the learner disagree

def run_up(cfg: Config, *, generators: int | None = None, run_dir: str | None = None,
           config_source: str | None = None, status_every_s: float = 1.0, resume: bool = False,
           learner_ranks: int | None = None, gpus: str | None = None, generators_per_gpu: int | None = None,
           colocate: bool | None = None, plan_only: bool = False, gpu_gib: float | None = None) -> int:
    _apply_options(cfg, generators=generators, run_dir=run_dir, resume=resume)
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
    watch = Watch(cfg, env, rd / "metrics.jsonl")
    children: list[Child] = []
    code, interrupted = 0, False
    previous = _interrupt_on_signals()
    try:
        children = start_children(cfg, rd, config_path, env, plan)
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
    finish_run(rd, watch, interrupted)
    owner.close()
    return code


def _apply_options(cfg: Config, *, generators: int | None, run_dir: str | None, resume: bool) -> None:
    """The command line's choices, into the config every child reads."""
    if resume:
        cfg.learner.resume, cfg.learner.fresh = True, False
    if run_dir:
        cfg.run_dir = run_dir
    if generators is not None:
        cfg.rollout.num_generators = generators


def _apply_launch(cfg: Config, *, learner_ranks: int | None, gpus: str | None, generators_per_gpu: int | None,
                  colocate: bool | None) -> None:
    """The placement flags, into ``cfg.launch``; several learner ranks need the deepspeed backend, unless they
    are one sequence-parallel group (:func:`backend_for_ranks`)."""

    if gpus is not None:
        parse_gpus(gpus)  # a malformed --gpus is a one-line PlacementError, not a validation dump
        cfg.launch.gpus = gpus
    if learner_ranks is not None:
        cfg.launch.learner_ranks = learner_ranks
    if generators_per_gpu is not None:
        cfg.launch.generators_per_gpu = generators_per_gpu
    if colocate is not None:
        cfg.launch.colocate = colocate
    backend = backend_for_ranks(cfg.learner.backend, cfg.launch.learner_ranks, cfg.learner.sequence_parallel)
    if backend != cfg.learner.backend:
        cfg.learner.backend = backend
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


def main(args) -> int:
    # --sync is rollout.sync=true, loaded with the config: its own check implies learner.max_staleness 0
    cfg = load_config(args.config, [*args.overrides, "rollout.sync=true"] if args.sync else args.overrides)
    return run_up(cfg, generators=args.generators, run_dir=args.run_dir,
                  config_source=args.config, resume=args.resume, learner_ranks=args.learner_ranks, gpus=args.gpus,
                  generators_per_gpu=args.generators_per_gpu, colocate=args.colocate, plan_only=args.plan,
                  gpu_gib=args.gpu_gib)
