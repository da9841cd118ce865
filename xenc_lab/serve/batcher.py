"""Cross-client batching: concurrent requests' pairs scored together in one ``Scorer.predict`` call.

A worker thread takes the oldest queued request and every later one queued with the same options (max_length,
activation), up to ``max_batch_pairs`` pairs, lays their pairs end to end (each request's pairs contiguous and in
order, so a decoder's 1:N request keeps its shared prefix within one window) and splits the scores back: each request
gets exactly its own. The queue is bounded; a full queue refuses at once rather than letting latency grow.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from ..engine import INPUT_BLOCK
from .truncation import truncating_from

MAX_BATCH_PAIRS = INPUT_BLOCK  # pairs of one predict call at most: one input block of the engine


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests: the caller is to retry later."""


class Unavailable(RuntimeError):
    """The worker has stopped or is stopping (shutdown): the caller is to retry later, elsewhere."""


@dataclass(slots=True, frozen=True)
class CallOptions:
    """What must be equal for requests to share a predict call."""

    max_length: int | None  # None: the Scorer's own
    activation: bool  # False: raw logits
    truncation_side: str | None = None  # None: the tokenizer's own
    cache_salt: str | None = None  # requests of different salts never share a call


@dataclass(slots=True)
class Job:
    pairs: list[tuple[str, str]]
    options: CallOptions
    future: Future  # float32 scores (len(pairs),), or the error predict raised


class Batcher:
    """Scores queued requests on one worker thread (the Scorer takes one call at a time anyway), several requests per
    ``predict`` call. ``calls``, ``requests`` and ``pairs`` count what it ran, for benchmarks and tests;
    ``on_call(requests, pairs, computed)`` hears of each call (``computed``: the tokens the model ran where the Scorer
    counts them, a decoder sharing prefixes; else None)."""

    def __init__(self, scorer, max_queue: int = 256, max_batch_pairs: int = MAX_BATCH_PAIRS, on_call=None):
        if max_queue < 1 or max_batch_pairs < 1:
            raise ValueError(f"max_queue and max_batch_pairs must be positive, got {max_queue} and {max_batch_pairs}")
        self.scorer = scorer
        self.max_queue = max_queue
        self.max_batch_pairs = max_batch_pairs
        self.calls = self.requests = self.pairs = 0
        self.on_call = on_call
        self.counted = None  # whether the Scorer counted the tokens it ran in its last call (None: no call yet)
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._raw = torch.nn.Identity()  # the activation of use_activation=false: logits as they are
        self._thread = threading.Thread(target=self._loop, name="xenc-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting for a call (not the ones in the call running, nor ones given up)."""
        with self._cond:
            return sum(not job.future.cancelled() for job in self._jobs)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, pairs: list[tuple[str, str]], max_length: int | None, activation: bool,
               truncation_side: str | None = None, cache_salt: str | None = None) -> Future:
        """Queue a request's pairs; its future gets their scores. QueueFull when ``max_queue`` requests wait,
        Unavailable once closed."""
        job = Job(list(pairs), CallOptions(max_length, activation, truncation_side, cache_salt), Future())
        with self._cond:
            if self._closed or not self._thread.is_alive():
                raise Unavailable("the server is shutting down" if self._closed
                                  else "the engine's worker is not running")
            if len(self._jobs) >= self.max_queue:  # requests given up free their places
                self._jobs = deque(waiting for waiting in self._jobs if not waiting.future.cancelled())
            if len(self._jobs) >= self.max_queue:
                raise QueueFull(f"{len(self._jobs)} requests are queued (--max-queue {self.max_queue})")
            self._jobs.append(job)
            self._cond.notify()
        return job.future

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop after the call in progress (which finishes and answers); requests still queued fail with Unavailable.
        ``timeout=0`` returns at once (a graceful shutdown's first step)."""
        with self._cond:
            self._closed = True
            left, self._jobs = list(self._jobs), deque()
            self._cond.notify_all()
        for job in left:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(Unavailable("the server is shutting down"))
        if timeout != 0 and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _take(self) -> list[Job] | None:
        """The next call's requests (None: closed): the oldest, then later ones with its options while they fit."""
        with self._cond:
            while not self._jobs and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            first = self._jobs.popleft()
            taken, size, kept = [first], len(first.pairs), deque()
            for job in self._jobs:
                if job.future.cancelled():
                    continue
                if job.options == first.options and size + len(job.pairs) <= self.max_batch_pairs:
                    taken.append(job)
                    size += len(job.pairs)
                else:
                    kept.append(job)
            self._jobs = kept
        return [job for job in taken if job.future.set_running_or_notify_cancel()]  # a client gone: skipped

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        options = jobs[0].options
        pairs = [pair for job in jobs for pair in job.pairs]
        try:
            with truncating_from(self.scorer, options.truncation_side):
                scores = self.scorer.predict(pairs, max_length=options.max_length, show_progress_bar=False,
                                             activation_fn=None if options.activation else self._raw)
            counts = getattr(self.scorer, "token_counts", None)  # the call's tokens where the Scorer counts them
        except (ValueError, TypeError) as err:  # the Scorer refused some input: each request alone finds whose
            if len(jobs) == 1:
                jobs[0].future.set_exception(err)
            else:
                for job in jobs:
                    self._run([job])
            return
        except BaseException as err:  # noqa: BLE001 (the engine failed: every request of the call hears of it, and
            # the worker lives on; a Rust panic in the tokenizer is a BaseException, which the server would not catch)
            err = err if isinstance(err, Exception) else RuntimeError(f"the engine failed: {err!r}")
            for job in jobs:
                job.future.set_exception(err)
            return
        scores = np.asarray(scores, dtype=np.float32).reshape(len(pairs))
        self.calls += 1
        self.requests += len(jobs)
        self.pairs += len(pairs)
        self.counted = counts is not None and counts.total > 0
        if self.on_call is not None:
            self.on_call(len(jobs), len(pairs), counts.computed if self.counted else None)
        start = 0
        for job in jobs:
            job.future.set_result(scores[start : start + len(job.pairs)])
            start += len(job.pairs)
