"""The `streamgrpo` command line (every command: `streamgrpo --help`; the manual: README.md).

Only argparse and the config module are imported at start-up, so `--help` is fast and torch stays
out of `sys.modules` until a command that needs it runs: each parser names the function that runs its command
(``run="module:function"``, in :mod:`streamgrpo.commands`), whose module is imported only when it runs.

A mistake the user can fix ends the command with one line on stderr, ``streamgrpo <command>:
<what is wrong>``, and no Python traceback (``-v`` logs the traceback as well). Exit codes:

* 0: done.
* 1: the command ran and failed: Redis refused the connection (wrong password, TLS settings, ACL
  permissions) or stayed down longer than ``queue.max_outage_s``; the data had no usable record; one
  prompt alone ran a generator out of memory (the line names the settings to lower).
* 2: a usage or config mistake, found before any work: a bad key or value (NaN and inf included),
  no Redis configured, a data file (``data.train_path``, ``--data``, ``--input``) that does not
  exist; argparse's own usage errors exit 2 too.
* 130: interrupted (Ctrl-C).

``learner`` and ``generator`` check their data file and Redis
(:func:`streamgrpo.commands.checks.check_before_loading`) before they load a model, so these mistakes end them
within seconds; a Redis that is down is not a mistake: their queue waits for it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from streamgrpo import versions
from streamgrpo.config import ConfigError, shipped_configs
from streamgrpo.config.recipes import hooks
from streamgrpo.config.schema import RECIPES

USAGE_EXIT = 2  # the command line or config is wrong (nothing ran)
FAILED_EXIT = 1  # the command ran and failed (Redis refused us, unusable data)


def _add_config_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--config", default=default,
                   help=f"YAML file or shipped config name ({', '.join(shipped_configs())})")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set loss.beta=0.04 (repeatable; seed-era flat names accepted)",
    )


# ------------------------------------------------------------------------------------- parser
class _Versions(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(versions.report())
        parser.exit()


ROLES = ("up", "learner", "generator", "evaluator", "relay")
"""The commands that run a role: each checks the installed releases first (streamgrpo/versions.py)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamgrpo",
        description="Asynchronous GRPO for Qwen vision-language models on video and image questions.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_Versions, nargs=0,
                        help="print the installed releases of streamgrpo, torch, transformers, vLLM, DeepSpeed, "
                             "flash-attn, peft (and the tested ranges) and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("up", help="everything on one machine: Redis, learner, N generators, live status")
    _add_config_args(p, default="demo")
    p.add_argument("--generators", type=int, default=None, help="number of generator processes (default: rollout.num_generators)")
    p.add_argument("--run-dir", default=None, help="run directory (default: run_dir from the config)")
    p.add_argument("--sync", action="store_true", help="on-policy mode: generate for version v only once v is applied")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in the run directory (default: a new run; the previous one moves to previous/)")
    p.add_argument("--learner-ranks", type=int, default=None,
                   help="learner ranks under torchrun, one GPU each (gloo ranks on the CPU); default launch.learner_ranks")
    p.add_argument("--gpus", default=None,
                   help="GPUs to place processes on: 0-7, 0,1,4-5 or cpu (default launch.gpus: every visible one)")
    p.add_argument("--generators-per-gpu", type=int, default=None, help="generators sharing one GPU (default 1)")
    p.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=None,
                   help="put generators on the learner's GPUs too, when the memory plan allows")
    p.add_argument("--plan", action="store_true", help="print where each process would run, and exit")
    p.add_argument("--gpu-gib", type=float, default=None,
                   help="memory of one GPU for the plan's check (default: what CUDA reports; none on a CPU)")
    p.set_defaults(run="streamgrpo.commands.up:main")

    p = sub.add_parser("slurm", help="the sbatch script of a run on N Slurm nodes (learner, generators, relays, "
                                     "Redis without root, the evaluator, Prometheus targets)")
    p.add_argument("--config", required=True, help="the YAML file every node reads (on shared storage)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (the plan uses it, and every process of the job gets it)")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the allocation")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of each node (default 8)")
    p.add_argument("--generators", type=int, default=None,
                   help="generators in the job, one GPU each (default rollout.num_generators: size it as "
                        "docs/cluster.md says, seconds per group x groups the learner trains per second)")
    p.add_argument("--generators-per-node", type=int, default=None,
                   help="at most this many generators per node (default: every GPU left); they fill the nodes in "
                        "order, so fewer relays serve them")
    p.add_argument("--learner-ranks", type=int, default=None,
                   help="learner ranks, one GPU each, from the first node on (default launch.learner_ranks)")
    p.add_argument("--learner-nodes", type=int, default=None,
                   help="spread the learner's ranks evenly over this many nodes (default: fill each node's GPUs); "
                        "the GPUs left beside them take generators")
    p.add_argument("--out", default=None, help="write the script here (default: print it)")
    p.add_argument("--job-name", default="streamgrpo", help="#SBATCH --job-name")
    p.add_argument("--time", default="24:00:00", help="#SBATCH --time")
    p.add_argument("--grace-s", type=int, default=300,
                   help="seconds between Slurm's SIGTERM (#SBATCH --signal=B:TERM@N) and the time limit: the learner "
                        "checkpoints, the rest stops, the job is requeued (default 300)")
    p.add_argument("--partition", default=None, help="#SBATCH --partition")
    p.add_argument("--python", default="python", help="the Python with streamgrpo on every node (default: python)")
    p.set_defaults(run="streamgrpo.commands.slurm:main")

    p = sub.add_parser("learner", help="one learner (under torchrun/deepspeed for many ranks)")
    _add_config_args(p)
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run directory")
    start.add_argument("--fresh", action="store_true",
                       help="start at step 0 although the run directory has checkpoints (they move to previous/)")
    p.add_argument("--from-weights", default=None, metavar="CKPT",
                   help="start at step 0 from a checkpoint's weights, with a fresh optimizer (learner.from_weights)")
    p.add_argument("--run-dir", default=None, help="run directory (overrides run_dir)")
    p.set_defaults(run="streamgrpo.commands.learner:main")

    p = sub.add_parser("generator", help="one generator")
    _add_config_args(p)
    p.add_argument("--id", type=int, required=True, help="generator index K (reads shard K of rollout.num_generators)")
    p.add_argument("--local-index", type=int, default=0,
                   help="this generator's index among the generators of its host (e.g. $SLURM_LOCALID under "
                        "srun --ntasks-per-node): with a fixed metrics.port P it serves /metrics on P + this")
    p.add_argument("--run-dir", default=None, help="run directory (overrides run_dir)")
    p.set_defaults(run="streamgrpo.commands.generator:main")

    p = sub.add_parser("evaluator", help="held-out accuracy at the learner's weight versions, while it trains")
    p.add_argument("--run-dir", default=None, help="override run_dir")
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.evaluator:main")

    p = sub.add_parser("relay", help="one copy of each weight version per host, for that host's generators "
                                     "(weights.relay; generators start it themselves)")
    _add_config_args(p)
    p.add_argument("--run-dir", default=None, help="override run_dir")
    p.add_argument("--client-key", default=None,
                   help="CURVE client key in weights.curve_keys_dir/clients, e.g. client-3 (a generator starting the "
                        "relay passes its own)")
    p.add_argument("--idle-exit-s", type=float, default=None,
                   help="exit after this long with no generator connected (default 60; a launcher that starts the "
                        "relay before its generators load, as `streamgrpo slurm`'s script does, gives more)")
    p.set_defaults(run="streamgrpo.commands.relay:main")
    p = sub.add_parser("infer", help="inference on a video/image + prompt, or a JSONL batch")
    p.add_argument("--model", required=True, help="checkpoint dir, merged model, base model or hub id")
    p.add_argument("--adapter", default=None, help="LoRA adapter directory on top of --model")
    p.add_argument("--video", action="append", default=[], help="video file (repeatable)")
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--prompt", default=None, help="question text (single mode)")
    p.add_argument("--input", default=None, help="records JSON/JSONL (batch mode)")
    p.add_argument("--output", default=None, help="results JSONL (batch mode; resumable)")
    p.add_argument("--format", choices=["think", "no_think"], default=None,
                   help="answer format instruction (default: the config's data.prompt_format)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: rollout.max_completion_length")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="hf (default) or vllm (needs vLLM; rollout.vllm.* settings apply; no --adapter)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts per generate call (default 8; 64 with --engine vllm, which schedules them itself)")
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.infer:run_infer")

    p = sub.add_parser("eval", help="accuracy and rewards on held-out data; before/after table")
    p.add_argument("--model", required=True)
    p.add_argument("--baseline", default=None, help="model to compare against (e.g. the starting point)")
    p.add_argument("--data", required=True, help="held-out records JSON/JSONL")
    p.add_argument("--rewards", default=None, help="comma-separated reward names (default: the config's)")
    p.add_argument("--samples", type=int, default=1, help="K samples per prompt (pass@k / mean@k); 1 = greedy")
    p.add_argument("--out", default=None, help="output directory for eval.json / eval.md")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many records")
    p.add_argument("--adapter", default=None, help="LoRA adapter directory on top of --model")
    p.add_argument("--format", choices=["think", "no_think"], default=None,
                   help="answer format instruction (default: the config's data.prompt_format)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: 0 (greedy) with --samples 1, else rollout.temperature")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: rollout.max_completion_length")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--shuffle-frames", action="store_true",
                   help="temporal probe: answer every record again with each video's frames in a random order; "
                        "the table shows ordered vs shuffled accuracy per question kind")
    p.add_argument("--shuffle-seed", type=int, default=None, metavar="N",
                   help="seed of the frame shuffle (with --shuffle-frames; default 0)")
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.evaluate:run_eval")

    p = sub.add_parser("report", help="PNG plots of reward, KL, staleness, throughput from a run directory")
    p.add_argument("run_dir")
    p.set_defaults(run="streamgrpo.commands.report:main")

    data = sub.add_parser("data", help="data set tools").add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.required = True
    p = data.add_parser("check", help="validate a data set and print a report")
    p.add_argument("path")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--allow-errors", action="store_true", help="exit 0 even when records have errors")
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.data_tools:check")
    for recipe, make_data in hooks(RECIPES, "make_data"):  # `data demo`: the recipes' synthetic data sets
        p = data.add_parser(recipe.name, help=(make_data.__doc__ or f"the {recipe.name} recipe's data set").split("\n")[0])
        p.add_argument("--out", required=True)
        p.add_argument("--n", type=int, default=2000)
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(run="streamgrpo.commands.data_tools:make", recipe=recipe.name)

    queue = sub.add_parser("queue", help="queue tools").add_subparsers(dest="queue_command", metavar="SUBCOMMAND")
    queue.required = True
    p = queue.add_parser("check", help="run the learner's checks on queued messages (or a file of them) without "
                                       "training: one OK/DROP line each, with the reason")
    p.add_argument("--file", default=None, help="a file of messages one after another (default: the run's Redis stream)")
    p.add_argument("--count", type=int, default=100, help="stream entries to check, oldest first")
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.queue_check:main")

    check = sub.add_parser("check", help="checks before a run").add_subparsers(dest="check_command", metavar="SUBCOMMAND")
    check.required = True
    p = check.add_parser("agreement", help="sample with the generator's engine, recompute along the learner's path: "
                                           "do they compute the same policy? (exit 1 when not, with the cause)")
    p.add_argument("--groups", type=int, default=2, help="prompts to sample (G completions each)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens per sample at most (0: the config's)")
    p.add_argument("--max-kl", type=float, default=None, help="the threshold (default learner.agreement_max_kl)")
    p.add_argument("--no-diagnose", action="store_true", help="measure only; do not look for the cause")
    p.add_argument("--out", default=None, help="also write the verdict as JSON to this file")
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.agreement:main")

    weights = sub.add_parser("weights", help="weight channel tools").add_subparsers(dest="weights_command",
                                                                                 metavar="SUBCOMMAND")
    weights.required = True
    p = weights.add_parser("pull", help="receive one weight version from the learner into a .safetensors file")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up (exit 1) after this long without a version")
    p.add_argument("--client-key", default=None, help="with CURVE keys: the client key pair to use, e.g. client-0")
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.weights_pull:main")

    model = sub.add_parser("model", help="model tools").add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    model.required = True
    p = model.add_parser("tiny", help="build a tiny random model + tokenizer + processor offline")
    p.add_argument("--out", required=True)
    p.add_argument("--arch", choices=["qwen2_5_vl", "qwen3_vl"], default="qwen2_5_vl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=["tiny", "3b", "7b", "8b"], default="tiny",
                   help="tiny (tests, demo), or real layer sizes with random weights (GPU measurements): Qwen2.5-VL "
                        "3b/7b, Qwen3-VL 8b")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers and vision blocks (default: the size's own); e.g. --size 3b --layers 2 for the "
                        "real layer shapes on a CPU")
    p.add_argument("--config-only", action="store_true",
                   help="write only config.json (enough for `config memory` and `up --plan` at a real size)")
    p.add_argument("--warm-format", action="store_true",
                   help="teach the answer format (not the answers) on the prompts of --config's data (default: demo)")
    p.add_argument("--warm-steps", type=int, default=60)
    _add_config_args(p)
    p.set_defaults(run="streamgrpo.commands.model_tools:tiny")
    p = model.add_parser("merge", help="merge a LoRA adapter into its base model")
    p.add_argument("--adapter", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--base", default=None, help="base model (default: the adapter's base_model_name_or_path)")
    p.set_defaults(run="streamgrpo.commands.model_tools:merge")
    p = model.add_parser("export", help="a checkpoint in the Hugging Face Hub's layout: safetensors, config, processor, "
                                        "a model card with the run's config, metrics and evaluation")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory, or a run directory (its newest)")
    p.add_argument("--out", required=True, help="the directory to write (new or empty)")
    p.add_argument("--adapter", action="store_true", help="LoRA: keep the adapter (peft layout) instead of merging "
                   "it into the base model")
    p.add_argument("--base", default=None, help="LoRA: the base model (default: the adapter's base_model_name_or_path);"
                   " with --adapter, the Hub id written into adapter_config.json")
    p.add_argument("--config", default=None, help="the run's config file, when its run directory has no config.yaml")
    p.set_defaults(run="streamgrpo.commands.model_tools:export")
    p = model.add_parser("push", help="upload an exported model directory to the Hugging Face Hub (huggingface_hub; "
                                      "token: HF_TOKEN or `hf auth login`)")
    p.add_argument("folder", metavar="DIR", help="the output of `streamgrpo model export`")
    p.add_argument("--repo", required=True, help="the Hub repository, ORG/NAME (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--message", default=None, help="the commit message")
    p.set_defaults(run="streamgrpo.commands.model_push:run_push")

    cfg = sub.add_parser("config", help="config tools").add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    cfg.required = True
    p = cfg.add_parser("show", help="print the resolved config")
    _add_config_args(p, default="demo")
    p.set_defaults(run="streamgrpo.commands.config_tools:show")
    p = cfg.add_parser("memory", help="a learner rank's memory plan: static parts and what a step adds (from the model config alone)")
    _add_config_args(p, default="demo")
    p.add_argument("--ranks", type=int, default=None,
                   help="learner ranks (ZeRO partitions over them; default launch.learner_ranks)")
    p.add_argument("--gpu-gib", type=float, default=None, help="GPU memory to check against (default: this "
                   "machine's GPU, else 80)")
    p.set_defaults(run="streamgrpo.commands.config_tools:memory")
    p = cfg.add_parser("init", help="write a commented starting config from a shipped one")
    p.add_argument("out", metavar="FILE", help="the YAML file to write (e.g. my.yaml)")
    p.add_argument("--from", dest="source", default="demo",
                   help="the shipped config to start from (default: demo; `--config` lists them)")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.set_defaults(run="streamgrpo.commands.config_tools:init")
    p = cfg.add_parser("reference", help="the configuration reference (docs/config.md), from the fields' docstrings")
    p.add_argument("--out", default=None, metavar="PATH", help="write it to this file (default: print it)")
    p.add_argument("--check", action="store_true",
                   help="with --out: write nothing, exit 1 when the file differs from what would be written")
    p.set_defaults(run="streamgrpo.commands.config_tools:reference")

    p = sub.add_parser("keys", help="CURVE key pairs for the weight channel")
    p.add_argument("--out", required=True)
    p.add_argument("--clients", type=int, default=4, help="client key pairs to make")
    p.set_defaults(run="streamgrpo.commands.keys:main")
    return parser


# The errors a user can fix, by module: (module, exception class names, exit code). Looked up only if the
# module was imported: the exception cannot be one of its own otherwise, and the CLI stays free of imports.
USER_ERRORS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("streamgrpo.versions", ("UntestedRelease",), USAGE_EXIT),
    ("streamgrpo.data.records", ("DataFileNotFound",), USAGE_EXIT),
    ("streamgrpo.data.records", ("DataError",), FAILED_EXIT),
    ("streamgrpo.transport.queue.redis_stream", ("QueueError",), FAILED_EXIT),
    ("streamgrpo.learner.memory.plan", ("MemoryPlanError",), USAGE_EXIT),
    ("streamgrpo.learner.checkpoint.files", ("CheckpointUnusable", "CheckpointWriteError"), FAILED_EXIT),
    ("streamgrpo.learner.memory.oom", ("LearnerOutOfMemory",), FAILED_EXIT),
    ("streamgrpo.learner.intake.media", ("MediaUnavailable",), FAILED_EXIT),
    ("streamgrpo.generator.oom", ("PromptDoesNotFit",), FAILED_EXIT),
    ("streamgrpo.engines.vllm_start", ("VLLMStartError",), FAILED_EXIT),
    ("streamgrpo.engines.vllm", ("VLLMNotInstalled",), USAGE_EXIT),
    ("streamgrpo.transport.weights.shm", ("ShmUnavailable",), USAGE_EXIT),
    ("streamgrpo.models.export", ("ExportError",), USAGE_EXIT),
    ("streamgrpo.commands.model_push", ("NotAnExport",), USAGE_EXIT),
    ("streamgrpo.commands.model_push", ("PushError",), FAILED_EXIT),
)


def _user_error(exc: BaseException) -> int | None:
    """The exit code of a mistake the user can fix (reported in one line), None for anything else."""
    if isinstance(exc, ConfigError):
        return USAGE_EXIT
    for module, names, code in USER_ERRORS:
        mod = sys.modules.get(module)
        if mod is not None and isinstance(exc, tuple(getattr(mod, n) for n in names)):
            return code
    return None


def command(run: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs a command, ``"module:function"`` (each parser's ``run``), its module imported now."""
    module, name = run.split(":")
    return getattr(importlib.import_module(module), name)


def command_name(args: argparse.Namespace) -> str:
    """``learner``, ``config show``, ``data check``...: the words that chose the command."""
    words = [args.command]
    for attr in ("check_command", "config_command", "data_command", "model_command", "queue_command",
                 "weights_command"):
        if getattr(args, attr, None):
            words.append(getattr(args, attr))
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        if args.command in ROLES:
            versions.check_at_start(args.command)
        return int(command(args.run)(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        code = _user_error(exc)
        if code is None:
            raise
        logging.getLogger("streamgrpo.cli").debug("traceback of the error below", exc_info=True)
        print(f"streamgrpo {command_name(args)}: {exc}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
