"""A running dispatch can be stopped, and the process lives on:

* Ctrl-C (SIGINT) during a dispatch from the main thread stops it and raises
  KeyboardInterrupt, whatever the kernel is doing (an endless loop in plain code, in a
  fiber, in a sanitized build), with one worker or several;
* any Python signal handler that raises (an alarm's, pytest-timeout's) stops a dispatch from
  the main thread, and its exception comes out of the launch; one that does not raise
  leaves the dispatch running;
* ``timeout=`` (or ``$TSM_EMU_TIMEOUT``) stops a dispatch that runs too long with
  ``KernelFault("hang")``, also from other threads;
* ``fork()`` while another thread is inside a dispatch gives a child that can dispatch
  and compile.

After each, the next launch of the same library works and SIGINT is Python's again. Every
scenario runs in a subprocess with a deadline, so a regression fails the test instead of
hanging the suite or killing it with a stray KeyboardInterrupt.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PRELUDE = r'''
import os, signal, sys, threading, time
import torch
from torch_sparse_metal.emulator import KernelFault, LaunchError, compile_shader

SRC = """
#include <metal_stdlib>
using namespace metal;
// Spins until flag[0] becomes nonzero, which nobody does: an endless loop in plain code.
kernel void spin(device atomic_int* flag [[buffer(0)]], device int* out [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  while (atomic_load_explicit(flag, memory_order_relaxed) == 0) {}
  out[i] = 1;
}
// The same after a barrier: the threads are fibers.
kernel void spin_fiber(device atomic_int* flag [[buffer(0)]], device int* out [[buffer(1)]],
                       uint i [[thread_position_in_grid]]) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  while (atomic_load_explicit(flag, memory_order_relaxed) == 0) {}
  out[i] = 1;
}
// Endless without touching memory: the sanitizer's spin detector does not see it.
kernel void spin_registers(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  volatile int x = 0;
  while (x == 0) {}
  out[i] = 1;
}
kernel void fill(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = int(i);
}
"""
lib = compile_shader(SRC)
sanitized = compile_shader(SRC, sanitize=True)
flag = torch.zeros(1, dtype=torch.int32)
out = torch.zeros(4096, dtype=torch.int32)
MAIN = threading.main_thread().ident
# A run started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and
# Python then installs no handler of its own: Ctrl-C as a terminal gives it.
signal.signal(signal.SIGINT, signal.default_int_handler)


def ctrl_c_in(seconds):
    threading.Timer(seconds, lambda: signal.pthread_kill(MAIN, signal.SIGINT)).start()


def check_fill(library):
    o = torch.zeros(8, dtype=torch.int32)
    library.fill(o, threads=8)
    assert o.tolist() == list(range(8)), o


def launch(name, library=lib, **kw):
    if name == "spin_registers":
        getattr(library, name)(out, threads=4096, group_size=64, **kw)
    else:
        getattr(library, name)(flag, out, threads=4096, group_size=64, **kw)
'''


def run_script(body: str, env=None) -> str:
    script = PRELUDE + textwrap.dedent(body) + "\nprint('DONE')\n"
    environment = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=environment, timeout=240)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("DONE"), \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("workers", ["1", "3"])
def test_ctrl_c_stops_an_endless_dispatch(workers):
    run_script("""
        for name, library in (("spin", lib), ("spin_fiber", lib), ("spin_registers", lib),
                              ("spin_registers", sanitized)):
            ctrl_c_in(0.3)
            start = time.monotonic()
            try:
                launch(name, library)
                raise AssertionError(name + " returned")
            except KeyboardInterrupt:
                took = time.monotonic() - start
                assert 0.25 < took < 10, (name, took)
            check_fill(library)
        # SIGINT is Python's again: Ctrl-C in plain Python code raises as usual.
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ctrl_c_in(0.2)
        try:
            time.sleep(30)
            raise AssertionError("sleep was not interrupted")
        except KeyboardInterrupt:
            pass
    """, env={"TSM_EMU_WORKERS": workers})


def test_ctrl_c_with_a_python_handler_that_does_not_raise():
    run_script("""
        seen = []
        signal.signal(signal.SIGINT, lambda *a: seen.append(1))
        ctrl_c_in(0.3)
        try:
            launch("spin")
            raise AssertionError("returned")
        except KeyboardInterrupt as e:
            assert "kernel spin: stopped by Ctrl-C" in str(e), e
        time.sleep(0.1)  # the handler runs at the next check of the interpreter
        assert seen == [1], seen
        check_fill(lib)
    """)


@pytest.mark.parametrize("workers", ["1", "3"])
def test_a_python_signal_handler_that_raises_stops_a_dispatch(workers):
    run_script("""
        class Alarm(Exception):
            pass

        def on_alarm(signum, frame):
            raise Alarm("too slow")

        signal.signal(signal.SIGALRM, on_alarm)
        for name, library in (("spin", lib), ("spin_fiber", lib), ("spin_registers", lib),
                              ("spin_registers", sanitized)):
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            start = time.monotonic()
            try:
                launch(name, library)
                raise AssertionError(name + " returned")
            except Alarm as e:
                took = time.monotonic() - start
                assert 0.25 < took < 10, (name, took)
                assert "while kernel " + name + " ran" in " ".join(e.__notes__), e.__notes__
            check_fill(library)
        # A handler that returns leaves the dispatch running (here until its time limit).
        ticks = []
        signal.signal(signal.SIGALRM, lambda *a: ticks.append(1))
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        try:
            launch("spin", timeout=1.0)
            raise AssertionError("returned")
        except KernelFault as e:
            assert e.kind == "hang", e
        assert ticks == [1], ticks
        check_fill(lib)
    """, env={"TSM_EMU_WORKERS": workers})


def test_an_ignored_sigint_does_not_stop_a_dispatch():
    run_script("""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ctrl_c_in(0.2)
        try:
            launch("spin", timeout=1.0)
            raise AssertionError("returned")
        except KernelFault as e:
            assert e.kind == "hang"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    """)


@pytest.mark.parametrize("workers", ["1", "3"])
def test_a_time_limit_stops_a_dispatch_with_a_hang_fault(workers):
    run_script("""
        for name, library in (("spin", lib), ("spin_fiber", lib), ("spin_registers", sanitized)):
            start = time.monotonic()
            try:
                launch(name, library, timeout=0.3)
                raise AssertionError(name + " returned")
            except KernelFault as e:
                took = time.monotonic() - start
                assert e.kind == "hang", e
                assert str(e) == (f"hang: kernel {name}: the dispatch did not finish within its "
                                  "time limit of 0.3 s (stopped; memory it wrote may be "
                                  "incomplete)"), e
                assert 0.25 < took < 10, took
            check_fill(library)
        # A dispatch that finishes in time is not disturbed by its limit.
        o = torch.zeros(100000, dtype=torch.int32)
        lib.fill(o, threads=100000, timeout=60)
        assert torch.equal(o, torch.arange(100000, dtype=torch.int32))
    """, env={"TSM_EMU_WORKERS": workers})


def test_the_time_limit_from_the_environment_and_from_another_thread():
    run_script("""
        result = []
        def other():
            try:
                launch("spin")
            except KernelFault as e:
                result.append(e.kind)
        t = threading.Thread(target=other)
        t.start()
        t.join(60)
        assert result == ["hang"], result
        os.environ["TSM_EMU_TIMEOUT"] = "abc"
        try:
            check_fill(lib)
            raise AssertionError("accepted")
        except LaunchError as e:
            assert "TSM_EMU_TIMEOUT='abc' is not a number of seconds" in str(e), e
        for bad in (0, -1, float("nan"), float("inf"), True, "1"):
            try:
                lib.fill(out, threads=8, timeout=bad)
                raise AssertionError(repr(bad))
            except LaunchError as e:
                assert "timeout must be a positive number of seconds" in str(e), e
    """, env={"TSM_EMU_TIMEOUT": "0.3"})


def test_fork_while_another_thread_is_inside_a_dispatch():
    """The child used to deadlock on its first launch: the dispatch lock belonged to a
    thread that does not exist in it. Likewise a compile in progress elsewhere."""
    run_script("""
        import torch_sparse_metal.emulator as metal
        HOLD = SRC.replace("kernel void fill", '''
        kernel void hold(device atomic_int* flag [[buffer(0)]], device atomic_int* started [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
          atomic_store_explicit(started, 1, memory_order_relaxed);
          while (atomic_load_explicit(flag, memory_order_relaxed) == 0) {}
        }
        kernel void fill''')
        held = compile_shader(HOLD)
        started = torch.zeros(1, dtype=torch.int32)
        t = threading.Thread(target=lambda: held.hold(flag, started, threads=1))
        t.start()
        while started[0] == 0:
            time.sleep(0.001)
        metal._lock.acquire()  # as a compile in progress on another thread would hold it
        pid = os.fork()
        if pid == 0:
            try:
                check_fill(held)
                check_fill(compile_shader(SRC + "// a new source: compiled in the child"))
                os._exit(0)
            except BaseException as e:
                print("child:", repr(e), flush=True)
                os._exit(3)
        metal._lock.release()
        flag[0] = 1
        t.join(30)
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the child hangs")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0, status
        check_fill(held)
    """)
