"""One stress thread: its own CUDA stream current and a side stream, its random sources and
checker, drawing operations by weight until the common deadline. An exception in an
operation is counted and reported, and the thread goes on (up to MAX_ERRORS_PER_THREAD)."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import random
import threading
import time

import torch

from tests.stress.checker import Checker
from tests.stress.env import Env
from tests.stress.ops import Op
from tests.stress.sources import Leaf, Sources
from tests.stress.stats import Recorder, log

MAX_ERRORS_PER_THREAD = 200  # a thread stops after this many exceptions (a sticky CUDA error)


class Shared:
    """The start line of a mode's threads: the clock starts once every thread is set up."""

    def __init__(self, n: int, seconds: float):
        self.seconds = seconds
        self.deadline = 0.0
        self.t0 = 0.0
        self.barrier = threading.Barrier(n, action=self._start)

    def _start(self) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.seconds


class Gate:
    """A readers-writer gate: many operations at once, or one that runs alone."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def hold(self, alone: bool):
        with self._cv:
            if alone:
                self._cv.wait_for(lambda: not self._writer and self._readers == 0)
                self._writer = True
            else:
                self._cv.wait_for(lambda: not self._writer)
                self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                if alone:
                    self._writer = False
                else:
                    self._readers -= 1
                self._cv.notify_all()


class Worker:
    def __init__(
        self,
        idx: int,
        env: Env,
        mode: str,
        installed: bool,
        seed: int,
        shared: Shared,
        gate: Gate,
        ops: list[Op],
        large_frac: float,
        medium_frac: float,
    ):
        self.idx = idx
        self.env = env
        self.installed = installed
        self.seed = seed
        self.shared = shared
        self.gate = gate
        self.rng = random.Random(seed)
        self.rec = Recorder(mode, idx)
        self.sources = Sources(env, self.rng, large_frac, medium_frac)
        self.checker = Checker(env, self.rec, self.rng)
        self.held_blocks: list[Leaf] = []  # pool blocks kept alive across operations (pool_hold)
        self.ops = ops
        self.op_cum = list(itertools.accumulate(op.weight for op in ops))
        self.thread = threading.Thread(target=self.run, name=f"stress-{mode}-{idx}", daemon=True)

    def setup(self) -> None:
        env = self.env
        if env.cuda:
            torch.cuda.set_device(env.device)
        self.stream = env.new_stream()
        self.side = env.new_stream()
        with env.stream_ctx(self.stream):
            self.sources.fill_random(self.seed)
        env.sync(self.stream)

    def draw(self) -> Op:
        i = bisect.bisect_right(self.op_cum, self.rng.random() * self.op_cum[-1])
        return self.ops[min(i, len(self.ops) - 1)]

    def run(self) -> None:
        ok = False
        try:
            self.setup()
            ok = True
        except Exception:
            self.rec.error("setup")
        try:
            self.shared.barrier.wait()
        except threading.BrokenBarrierError:
            return
        self.rec.t0 = self.shared.t0
        if not ok:
            return
        with self.env.stream_ctx(self.stream):
            while time.monotonic() < self.shared.deadline:
                op = self.draw()
                self.rec.call(op.name)
                try:
                    with self.gate.hold(alone=op.alone):
                        op.run(self)
                except Exception:
                    self.rec.error(op.name)
                if self.rec.stats.errors >= MAX_ERRORS_PER_THREAD:
                    log(f"[{self.thread.name}] {self.rec.stats.errors} errors: this thread stops")
                    break
            for op in self.ops:
                if op.finish is None:
                    continue
                try:
                    with self.gate.hold(alone=False):
                        op.finish(self)
                except Exception:
                    self.rec.error(op.name)
            try:
                self.checker.resolve()
                self.env.sync(self.stream)
                self.env.sync(self.side)
            except Exception:
                self.rec.error("final_resolve")
