"""The serving benchmark (``xenc-lab bench --serve``): N concurrent clients post /score requests for T seconds against
the app in this process, and the pairs/s served is set against ``Scorer.predict`` on the same pairs offline. Every
response is checked against its own pairs' offline scores, so a request given another's scores counts as a failure.

``drive`` is the load itself (also what the load test runs); the clients run in a process of their own here, so that
the server's process does only the server's work."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np

from ..provenance import provenance

DOCS_PER_REQUEST = 16


@dataclass
class LoadResult:
    """What the clients saw: requests answered right, failed (an error status or a transport error) and answered
    with scores other than their own; pairs answered right; latencies of the right answers."""

    seconds: float
    requests: int = 0
    failed: int = 0
    mismatched: int = 0
    pairs: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few, for the message

    @property
    def pairs_per_s(self) -> float:
        return self.pairs / self.seconds

    def latency_ms(self, q: float) -> float:
        return 1000 * float(np.quantile(self.latencies, q)) if self.latencies else float("nan")


def score_bodies(pairs: list[tuple[str, str]], docs: int = DOCS_PER_REQUEST) -> list[dict]:
    """/score bodies of ``docs`` pairs each, N:N."""
    return [{"text_1": [q for q, _ in pairs[i : i + docs]], "text_2": [d for _, d in pairs[i : i + docs]]}
            for i in range(0, len(pairs), docs)]


async def _client(client, bodies, expected, tol, warm_until, deadline, offset, result: LoadResult) -> None:
    i = offset
    while (start := time.perf_counter()) < deadline:
        k, i = i % len(bodies), i + 1
        try:
            response = await client.post("/score", json=bodies[k])
            ok = response.status_code == 200
            scores = np.array([d["score"] for d in response.json()["data"]]) if ok else None
        except Exception as err:  # noqa: BLE001 (a transport error or a malformed answer is a failure to count)
            ok, scores, response = False, None, err
        if start < warm_until:
            continue
        if not ok:
            result.failed += 1
            if len(result.errors) < 5:
                result.errors.append(str(getattr(response, "text", response))[:200])
        elif scores.shape != expected[k].shape or not np.allclose(scores, expected[k], rtol=tol, atol=tol):
            result.mismatched += 1
        else:
            result.requests += 1
            result.pairs += len(scores)
            result.latencies.append(time.perf_counter() - start)


async def _drive(url, bodies, expected, clients, seconds, warmup, tol) -> LoadResult:
    import httpx

    result = LoadResult(seconds)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        warm_until = time.perf_counter() + warmup
        deadline = warm_until + seconds
        await asyncio.gather(*(_client(client, bodies, expected, tol, warm_until, deadline, c, result)
                               for c in range(clients)))
    return result


def drive(url: str, bodies: list[dict], expected: list[np.ndarray], clients: int = 32, seconds: float = 5.0,
          warmup: float = 0.0, tol: float = 1e-4) -> LoadResult:
    """``clients`` concurrent clients (asyncio, one connection each) post the bodies in turn, each from its own place,
    for ``warmup`` then ``seconds`` seconds; what they see in the ``seconds`` counts. A response must carry its own
    pairs' ``expected`` scores within ``tol`` (a pair's score moves in the last bits with its batchmates)."""
    return asyncio.run(_drive(url, bodies, [np.asarray(e, dtype=np.float64) for e in expected], clients, seconds,
                              warmup, tol))


def _rate(fn, n: int) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def _merged(results: list[LoadResult]) -> LoadResult:
    """The rounds' results as one: their counts, latencies and seconds added up."""
    total = LoadResult(sum(r.seconds for r in results))
    for r in results:
        total.requests, total.failed, total.mismatched = (total.requests + r.requests, total.failed + r.failed,
                                                          total.mismatched + r.mismatched)
        total.pairs += r.pairs
        total.latencies += r.latencies
        total.errors += r.errors[: 5 - len(total.errors)]
    return total


def run(model=None, clients: int = 32, seconds: float = 30.0, workload: str = "short", n_pairs: int = 512,
        dtype: str = "float32", device: str = "cpu", compile: bool = False, rounds: int = 3) -> dict:
    """Served pairs/s with ``clients`` clients for ``seconds`` seconds in all, in ``rounds`` rounds (each after a short
    warm-up), alternating with offline runs on the same ``n_pairs`` pairs of ``workload`` (the pairs all at once, and
    one request's pairs per call) before, between and after them: the medians, so that load from elsewhere on the
    machine falls on both sides alike."""
    from .. import Scorer
    from ..bench.workloads import make_pairs
    from ..zoo import minilm_cross_encoder
    from .app import Limits, create_app
    from .server import ServerThread

    scorer = Scorer(model or minilm_cross_encoder(), device=device, dtype=dtype, compile=compile)
    pairs = make_pairs(workload, n_pairs, seed=7)
    bodies = score_bodies(pairs)
    scorer.predict(pairs[:64])  # warm up (and compile, where asked)
    all_at_once = lambda: scorer.predict(pairs)  # noqa: E731
    per_request = lambda: [scorer.predict(list(zip(b["text_1"], b["text_2"]))) for b in bodies]  # noqa: E731
    expected = per_request()
    app = create_app(scorer, "bench", Limits(max_queue=4 * clients))
    offline_all, offline_each, results, load = [], [], [], os.getloadavg()[0]
    with ServerThread(app) as server, ProcessPoolExecutor(1, mp_context=get_context("spawn")) as clients_process:
        for i in range(rounds + 1):  # the server is idle between rounds: the offline runs have the Scorer alone
            offline_all.append(_rate(all_at_once, len(pairs)))
            offline_each.append(_rate(per_request, len(pairs)))
            if i < rounds:
                results.append(clients_process.submit(drive, server.url, bodies, expected, clients, seconds / rounds,
                                                      min(2.0, seconds / rounds / 5)).result())
        batcher = app.state.batcher
        calls, requests = batcher.calls, batcher.requests
    return {"model": "MiniLM-L6 cross-encoder" if model is None else str(model), "dtype": dtype, "device": device,
            "workload": workload, "clients": clients, "seconds": seconds, "rounds": rounds,
            "result": _merged(results), "served": float(np.median([r.pairs_per_s for r in results])),
            "offline_all": float(np.median(offline_all)), "offline_each": float(np.median(offline_each)),
            "requests_per_call": requests / max(calls, 1), "load": (load, os.getloadavg()[0])}


def report_section(row: dict, command: str, machine: str) -> str:
    """The ``## Serving`` section of reports/throughput.md."""
    r: LoadResult = row["result"]
    served = row["served"]
    return "\n".join([
        "## Serving", "",
        provenance(command, machine), "",
        f"`xenc-lab serve`'s app (uvicorn, in a thread of the benchmark's process) and {row['clients']} concurrent "
        f"clients (httpx on asyncio, in a process of their own on the same machine) posting `/score` requests of "
        f"{DOCS_PER_REQUEST} (query, passage) pairs N:N, `make_pairs(\"{row['workload']}\")` texts, for "
        f"{row['seconds']:.0f} s in {row['rounds']} rounds, each after a short warm-up; each answer is checked against "
        "its own pairs' offline scores. Offline: `Scorer.predict` on the same pairs in the same process, before, "
        "between and after the rounds (the server idle), the pairs all in one call (the engine's best case) and one "
        "request's pairs per call (no batching across requests). Rates are medians over the rounds and over the "
        "offline runs; `requests` and `failed` (an error, or scores other than the request's own) are totals. "
        "`requests per engine call`: how many requests the batcher merged into each `predict` call, on average.", "",
        "| model | dtype | clients | requests | failed | pairs/s served | offline, all at once | ratio | "
        "offline, per request | ratio | latency p50 / p95 | requests per engine call |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {row['model']} | {row['dtype']} | {row['clients']} | {r.requests} | {r.failed + r.mismatched} | "
        f"{served:.1f} | {row['offline_all']:.1f} | {served / row['offline_all']:.2f}x | {row['offline_each']:.1f} | "
        f"{served / row['offline_each']:.2f}x | {r.latency_ms(0.5):.0f} / {r.latency_ms(0.95):.0f} ms | "
        f"{row['requests_per_call']:.1f} |", "",
        f"Load average (1 min) when the run began and ended: {row['load'][0]:.1f} and {row['load'][1]:.1f}, on "
        f"{os.cpu_count()} CPUs: other work on the machine, and the clients' own JSON and HTTP work, slow both sides; "
        "the rounds alternate with the offline runs so that it falls on both alike.", "",
    ])


def run_command(args) -> int:
    """``xenc-lab bench --serve``: prints the numbers; ``--report DIR`` writes DIR/throughput.md's serving section."""
    import shlex
    from pathlib import Path

    from ..bench.report import append_section, machine

    others = {"--workloads (more than one)": len(args.workloads or []) > 1, "--pairs-file": args.pairs_file,
              "--memory": args.memory, "--decoder": args.decoder is not None, "--dtypes (more than one)":
              len(args.dtypes or []) > 1}
    if given := [name for name, value in others.items() if value]:
        raise ValueError(f"--serve runs one model, dtype and workload: drop {', '.join(given)}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    row = run(args.model, clients=args.clients, seconds=args.seconds, workload=(args.workloads or ["short"])[0],
              n_pairs=args.pairs or 512, dtype=(args.dtypes or ["float32"])[0], device=args.device,
              compile=args.compile, rounds=args.repeats)
    r = row["result"]
    print(f"served {row['served']:.1f} pairs/s ({r.requests} requests, {r.failed} failed, {r.mismatched} with other "
          f"scores); offline {row['offline_all']:.1f} pairs/s all at once, {row['offline_each']:.1f} per request; "
          f"{row['requests_per_call']:.1f} requests per engine call")
    for error in r.errors:
        print(f"  failure: {error}")
    if args.report:
        path = append_section(Path(args.report) / "throughput.md",
                              report_section(row, "xenc-lab " + shlex.join(args.argv), machine(args.device)))
        print(f"wrote the serving section of {path}")
    return 0 if r.failed + r.mismatched == 0 else 1
