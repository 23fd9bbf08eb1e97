"""vLLM's start errors as one line (streamgrpo/engines/vllm_start.py): the reading of vLLM's messages
(pure), and the tap on file descriptors 1 and 2 with real child processes writing into it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from streamgrpo.engines.vllm_start import OutputTap, StartSettings, root_cause, start_error_line

GPU = StartSettings(gpu_memory_utilization=0.3, max_model_len=8192, cpu_kv_cache_gib=None, prompts_per_batch=4,
                    max_pixels=200704, max_frames=16)
CPU = StartSettings(gpu_memory_utilization=0.9, max_model_len=None, cpu_kv_cache_gib=1.0, prompts_per_batch=4,
                    max_pixels=200704, max_frames=16, on_cpu=True)

# vLLM's own messages as its engine core logs them (prefix and text as vLLM writes them)
KV = ("(EngineCore_DP0 pid=18799) ERROR 11-26 20:33:48 [core.py:708] ValueError: To serve at least one request "
      "with the models's max seq len (40960), (5.62 GiB KV cache is needed, which is larger than the available KV "
      "cache memory (4.50 GiB). Based on the available memory, the estimated maximum model length is 32768. Try "
      "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
NO_BLOCKS = ("(EngineCore_DP0 pid=7) ERROR [core.py:708] ValueError: No available memory for the cache blocks. Try "
             "increasing `gpu_memory_utilization` when initializing the engine.")
TAKEN = ("(EngineCore_DP0 pid=7) ERROR [core.py:708] ValueError: Free memory on device (20.1/79.1 GiB) on startup "
         "is less than desired GPU memory utilization (0.9, 71.2 GiB). Decrease GPU memory utilization or reduce GPU "
         "memory used by other processes.")
CPU_TAKEN = ("(EngineCore_DP0 pid=7) ERROR [core.py:708] ValueError: Available memory on node 0 (20.1/23.4 GiB) on kv "
             "cache allocation is less than requested memory for kv (1000.00 GiB). Decrease --kv-cache-memory-bytes, "
             "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.")
OOM = ("(EngineCore_DP0 pid=7) ERROR [core.py:708] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
       "2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.20 GiB is free.")
PARENT = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nRuntimeError: Engine core "
          "initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}")


def _log(*lines: str) -> str:
    return "\n".join(["INFO 11-26 [model_runner.py:1] Loading weights took 6.1 GiB",
                      "(EngineCore_DP0 pid=7) ERROR [core.py:700] EngineCore failed to start.",
                      "(EngineCore_DP0 pid=7) ERROR [core.py:700] Traceback (most recent call last):", *lines, PARENT])


def test_the_root_cause_is_the_child_error_not_the_parents_pointer():
    assert root_cause(_log(KV)).startswith("ValueError: To serve at least one request")
    assert root_cause(_log(OOM)).startswith("OutOfMemoryError: CUDA out of memory")
    # nothing but the parent's pointer: no cause
    assert root_cause(PARENT) is None
    # a memory error wins over a later unrelated one; otherwise the last error
    assert root_cause(_log(NO_BLOCKS, "KeyError: 'x'")).startswith("ValueError: No available memory")
    assert root_cause(_log("(EngineCore_DP0 pid=7) ERROR [core.py:708] KeyError: 'model.visual.x'")) == \
        "KeyError: 'model.visual.x'"


def test_each_cause_names_the_settings_that_change_it():
    line = start_error_line("generator-0", _log(KV), GPU, full_output="/run/logs/generator-0-vllm-start.log")
    assert "\n" not in line and line.startswith("generator-0: vLLM's KV cache does not fit: ValueError: To serve")
    assert "rollout.vllm.gpu_memory_utilization (now 0.3)" in line and "rollout.vllm.max_model_len (now 8192)" in line
    assert line.endswith("(vLLM's full output: /run/logs/generator-0-vllm-start.log)")
    cpu = start_error_line("generator-1", _log(KV), CPU)
    assert "rollout.vllm.cpu_kv_cache_gib (now 1.0)" in cpu and "rollout.vllm.gpu_memory_utilization" not in cpu
    assert "the engine.; " not in cpu and "the engine; raise" in cpu
    assert "the model's own length" in cpu
    taken = start_error_line("g", _log(TAKEN), GPU)
    assert "the memory vLLM asks for is not free" in taken and "gpu_memory_utilization (now 0.3)" in taken
    cpu_taken = start_error_line("g", _log(CPU_TAKEN), CPU)
    assert "the memory vLLM asks for is not free" in cpu_taken and "rollout.vllm.cpu_kv_cache_gib (now 1)" in cpu_taken
    oom = start_error_line("g", _log(OOM), GPU)
    assert "ran out of memory while starting" in oom
    assert all(k in oom for k in ("rollout.prompts_per_batch (now 4)", "data.max_pixels (now 200704)",
                                  "data.max_frames (now 16)"))
    other = start_error_line("g", _log("(EngineCore_DP0 pid=7) ERROR [core.py:708] KeyError: 'w'"), GPU)
    assert other == "g: vLLM could not start: KeyError: 'w'"
    assert start_error_line("g", "", GPU) == "g: vLLM could not start: no error message in its output"
    # a very long message is cut, the line stays one line
    long = start_error_line("g", "ValueError: " + "x" * 5000, GPU)
    assert "\n" not in long and len(long) < 600 and "..." in long


CHILD_FAILS = f"""
import sys
print("INFO loading the model", flush=True)
sys.stderr.write({KV!r} + "\\n")
sys.exit(1)
"""


def test_a_failed_start_keeps_the_childs_output_off_the_terminal_and_in_a_file(tmp_path, capfd):
    tap = OutputTap()
    with tap:
        os.write(2, b"held line of this process\n")  # (pytest's capfd swaps sys.stderr: write to the fd, as logging does)
        rc = subprocess.run([sys.executable, "-c", CHILD_FAILS]).returncode  # inherits fds 1 and 2: the pipe
    assert rc == 1
    text = tap.save(tmp_path / "logs" / "g-vllm-start.log", wait_s=2)
    out, err = capfd.readouterr()
    assert "KV cache is needed" not in out + err and "held line" not in out + err
    saved = (tmp_path / "logs" / "g-vllm-start.log").read_text()
    assert "INFO loading the model" in saved and "KV cache is needed" in saved and "held line" in saved
    assert root_cause(text).startswith("ValueError: To serve")
    os.write(2, b"after the tap\n")  # this process's own descriptors are back
    assert "after the tap" in capfd.readouterr().err


CHILD_LIVES = """
import sys
print("engine started", flush=True)
sys.stdin.readline()
sys.stderr.write("EngineDeadError: the engine core died\\n")
"""


def test_after_a_good_start_the_output_is_shown_and_the_children_are_forwarded(capfd):
    tap = OutputTap()
    with tap:
        child = subprocess.Popen([sys.executable, "-c", CHILD_LIVES], stdin=subprocess.PIPE)
        _wait(lambda: "engine started" in tap.text())
    assert "engine started" not in capfd.readouterr().err  # held until shown
    tap.show()
    assert "engine started" in _wait_capture(capfd, "engine started")
    child.stdin.write(b"go\n")
    child.stdin.close()
    assert child.wait(30) == 0
    assert "the engine core died" in _wait_capture(capfd, "the engine core died")  # forwarded after the start
    assert "EngineDeadError: the engine core died" in tap.text()  # and kept: it names a later death


def _wait(cond, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, "the tap never read the child's output"
        time.sleep(0.05)


def _wait_capture(capfd, needle: str) -> str:
    seen = ""

    def got() -> bool:
        nonlocal seen
        seen += capfd.readouterr().err
        return needle in seen

    _wait(got)
    return seen
