"""streamgrpo/runtime/collector.py: cyclic garbage collection paused through a process's start-up, resumed (with
what exists frozen) when the role says it is set up, after the limit, or in a forked child. Each case runs in its
own interpreter: the collector's state is the process's."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", "import gc, os, sys, threading, time\n"
                          "from streamgrpo.runtime import collector\n" + code],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_paused_until_started_then_what_exists_is_frozen_and_collection_resumes():
    got = _run("collector.pause()\n"
               "print(gc.isenabled(), gc.get_freeze_count())\n"
               "import json, email.parser\n"  # objects made while paused
               "collector.started()\n"
               "print(gc.isenabled(), gc.get_freeze_count() > 1000,\n"
               "      any(t.name == 'gc-after-startup' and t.is_alive() for t in threading.enumerate()))\n"
               "collector.started()\n"  # again: nothing more
               "print(gc.isenabled())\n")
    assert got == ["False", "0", "True", "True", "False", "True"]


def test_the_limit_resumes_collection_when_no_role_says_it_started():
    got = _run("collector.pause(limit_s=0.2)\n"
               "print(gc.isenabled())\n"
               "deadline = time.monotonic() + 60\n"
               "while not gc.isenabled() and time.monotonic() < deadline:\n"
               "    time.sleep(0.05)\n"
               "print(gc.isenabled(), gc.get_freeze_count() > 0)\n")
    assert got == ["False", "True", "True"]


def test_a_forked_child_collects_at_once():
    got = _run("collector.pause()\n"
               "r, w = os.pipe()\n"
               "pid = os.fork()\n"
               "if pid == 0:\n"
               "    os.write(w, str(gc.isenabled()).encode()); os._exit(0)\n"
               "os.waitpid(pid, 0)\n"
               "print(os.read(r, 16).decode(), gc.isenabled())\n")
    assert got == ["True", "False"]  # the child collects; the parent is still starting


def test_started_without_a_pause_changes_nothing():
    got = _run("collector.started()\nprint(gc.isenabled(), gc.get_freeze_count())\n"
               "gc.disable()\n"  # other code's choice, kept (in a forked child too)
               "collector.started()\n"
               "pid = os.fork()\n"
               "if pid == 0:\n"
               "    os._exit(0 if not gc.isenabled() else 3)\n"
               "print(gc.isenabled(), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    assert got == ["True", "0", "False", "0"]


def test_python_m_streamgrpo_starts_paused():
    out = subprocess.run([sys.executable, "-c", "import runpy, sys, gc\n"
                          "sys.argv = ['streamgrpo', '--version']\n"
                          "try:\n    runpy.run_module('streamgrpo', run_name='__main__')\n"
                          "except SystemExit:\n    pass\n"
                          "print(gc.isenabled())\n"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"  # a command that never says it started: the limit's timer resumes it
