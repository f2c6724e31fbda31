"""``kvmesh bench priority``: the priority mix on simulated workers (or real vLLM engines on a
built-in model, ``--engine vllm``), with flow control on and off (docs/tenants.md; after
llm-d-benchmark's priority-mix harness).

    kvmesh bench priority --workers 2 --burst-x 5
    kvmesh bench priority --engine vllm --model tiny --modes admission,reserve

Starts an etcd, ``--workers`` simulated workers (``kvmesh worker --engine simulated``, one
process each, vLLM's priority scheduling on) and a router with API keys for three tenants
(benchmarks/priority/workload.py): ``interactive`` (priority 10, a steady rate), ``batch``
(priority 0, bursting to ``--burst-x`` times the fleet's capacity) and ``flood`` (priority 0,
cold prompts at the fleet's capacity); the capacity is the simulator's model's
(``capacity_per_s``). Per router mode (``--admission`` on, then off): a phase with the
interactive tenant alone, and a phase with all three. Prints per phase and tenant: requests sent, answered,
refused (429 / RESOURCE_EXHAUSTED) and failed (deadline), TTFT p50 / p99, answered per second,
uncached prompt tokens and the refusals' latency; then the interactive tenant's TTFT p99 under
the burst against without it, Jain's index of batch and flood over their uncached tokens served
during the burst, and how busy the fleet was (share of samples with a running request).
``--results-jsonl`` also writes every request's result (TTFT, the engine's queue and prefill
time); ``--worker-args`` passes flags to the workers (``--long-prefill-token-threshold``);
``--floor`` prints instead the interactive TTFT floor on one simulated engine in virtual time
(``floor.py``). With ``--engine vllm`` the workers run real vLLM engines (``--model``, a
built-in name or a model directory; ``--sim-max-running`` is their ``max_num_seqs``), the
prompts' token ids are drawn from the model's vocabulary, and the fleet's capacity is measured
first (``--calibrate-s`` of batch-shaped requests, ``--calibrate-concurrency`` at once per
worker, through a router without flow control) instead of taken from the simulator's model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvmesh.client import make_request
from kvmesh.etcd_server import LocalEtcd, free_port
from kvmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.router.core.auth import hash_key
from services.worker.sim.model import SimWorkerConfig

from .workload import (
    AFTER_WAIT,
    ARRIVAL,
    FAILED,
    OK,
    REJECTED,
    VOCAB,
    Result,
    TenantLoad,
    TenantRow,
    format_rows,
    jain,
    percentile,
    served_between,
    summarize,
)

REPO = Path(__file__).resolve().parents[2]
CLUSTER = "bench-priority"
PRIORITY = {"interactive": 10, "batch": 0, "flood": 0}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "priority",
        help="priority mix on simulated workers: interactive vs a bursting batch tenant vs a "
        "cold-prompt flood, flow control on and off",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--engine",
        choices=("simulated", "vllm"),
        default="simulated",
        help="the workers' engine: the simulator, or real vLLM on --model",
    )
    p.add_argument("--model", default="tiny", help="with --engine vllm: a built-in model or a dir")
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="with --engine vllm: worker i's engine computes on core i mod the cores (one "
        "thread, --compute-cpus), as kvmesh up plans them; default: no binding",
    )
    p.add_argument(
        "--calibrate-s",
        type=float,
        default=6.0,
        help="with --engine vllm: seconds of batch-shaped load that measure the capacity",
    )
    p.add_argument(
        "--calibrate-concurrency",
        type=int,
        default=8,
        help="with --engine vllm: batch requests at once per worker while calibrating",
    )
    p.add_argument("--sim-max-running", type=int, default=64, help="per simulated engine")
    p.add_argument(
        "--sim-speedup",
        type=float,
        default=0.25,
        help="virtual seconds per real second (below 1: a slower model, fewer messages)",
    )
    p.add_argument("--burst-x", type=float, default=5.0, help="batch rate / fleet capacity")
    p.add_argument("--flood-x", type=float, default=1.0, help="flood rate / fleet capacity")
    p.add_argument("--burst-s", type=float, default=10.0, help="length of the burst")
    p.add_argument("--interactive-rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--request-timeout-s", type=float, default=20.0)
    p.add_argument(
        "--modes",
        default="admission,off",
        help="router modes to run: admission, off, reserve (admission with --reserve-workers "
        "workers kept for the interactive band: the scheduler's reserve filter)",
    )
    p.add_argument(
        "--reserve-workers",
        type=int,
        default=1,
        help="in mode reserve: workers reserved for the interactive band (priority 10)",
    )
    p.add_argument(
        "--reserve-lend-after-idle-s",
        type=float,
        default=10.0,
        help="in mode reserve: the reserve filter's lend_after_idle_s",
    )
    p.add_argument(
        "--router-args",
        default="--admission-max-waiting 2 --admission-max-prefill-backlog-s 0.2 "
        "--admission-reserve 0.5 --admission-reserve-priority 10 "
        "--admission-queue-max-requests 64 --admission-queue-ttl-s 10",
        help="flags of the router in the admission mode (beside --admission)",
    )
    p.add_argument(
        "--worker-args",
        default="",
        help="more flags of every simulated worker (e.g. --long-prefill-token-threshold 64)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="instead: the interactive TTFT floor on one simulated engine in virtual time, per "
        "engine and low-band limits (benchmarks/priority/floor.py; a second, no processes)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per mode")
    p.add_argument(
        "--results-jsonl",
        type=Path,
        default=None,
        help="write every request's result (phase, tenant, TTFT, engine queue and prefill) here",
    )
    p.set_defaults(func=run)


# ---- the mesh -------------------------------------------------------------------------------
@dataclass
class Proc:
    proc: asyncio.subprocess.Process
    address: str


async def spawn(module: str, args: Sequence[str], log: Path, ready: str) -> Proc:
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *args,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        if not line:
            raise RuntimeError(f"{module} exited before it was ready; see {log}")
        if line.startswith(ready):
            fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
            return Proc(proc, fields["address"])
    raise RuntimeError(f"{module} not ready in 120 s; see {log}")


async def stop(p: Proc) -> None:
    if p.proc.returncode is None:
        p.proc.terminate()
        try:
            await asyncio.wait_for(p.proc.wait(), 15)
        except TimeoutError:
            p.proc.kill()
            await p.proc.wait()


@contextlib.asynccontextmanager
async def mesh(a: argparse.Namespace, tmp: Path) -> AsyncIterator[tuple[LocalEtcd, list[Proc]]]:
    with LocalEtcd(data_dir=tmp / "etcd") as etcd:
        workers: list[Proc] = []
        try:
            for i in range(a.workers):
                workers.append(
                    await spawn(
                        "services.worker.main",
                        [
                            *engine_args(a, i),
                            "--scheduling-policy=priority",
                            f"--worker-id={'vllm' if a.engine == 'vllm' else 'sim'}-{i:02d}",
                            f"--cluster={CLUSTER}",
                            f"--etcd={etcd.endpoint}",
                            "--metrics-port=-1",
                            "--log-level=WARNING",
                            *a.worker_args.split(),
                        ],
                        tmp / f"worker-{i}.log",
                        "KVMESH_WORKER_READY",
                    )
                )
            yield etcd, workers
        finally:
            for w in workers:
                await stop(w)


def engine_args(a: argparse.Namespace, i: int) -> list[str]:
    """The flags that pick worker ``i``'s engine."""
    if a.engine == "vllm":
        pin = [f"--compute-cpus={i % (os.cpu_count() or 1)}"] if a.pin_cpus else []
        return [
            "--engine=vllm",
            f"--model={a.model_path}",
            "--max-model-len=2048",
            f"--max-num-seqs={a.sim_max_running}",
            *pin,
        ]
    return [
        "--engine=simulated",
        f"--sim-max-running={a.sim_max_running}",
        f"--sim-speedup={a.sim_speedup}",
    ]


def key_file(tmp: Path) -> Path:
    path = tmp / "keys.yaml"
    tree = {
        "tenants": {
            name: {"priority": prio, "keys": [hash_key(f"sk-{name}")]}
            for name, prio in PRIORITY.items()
        }
    }
    path.write_text(yaml.safe_dump(tree))
    return path


def reserve_profile(tmp: Path, workers: int, lend_after_idle_s: float) -> Path:
    """The router's default profile with the reserve filter: ``workers`` kept for the
    interactive band (docs/tenants.md, reserved workers)."""
    from services.router.core.scheduler import BUILTIN_PROFILES

    tree = yaml.safe_load(BUILTIN_PROFILES["precise-sticky"])
    tree["name"] = "precise-sticky-reserved"
    tree["filters"] = [
        *tree["filters"],
        {
            "type": "reserve",
            "params": {
                "bands": [{"priority": PRIORITY["interactive"], "workers": workers}],
                "lend_after_idle_s": lend_after_idle_s,
            },
        },
    ]
    path = tmp / "reserved.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


async def start_router(etcd: LocalEtcd, tmp: Path, mode: str, extra: str, n: int) -> Proc:
    args = [
        f"--cluster={CLUSTER}",
        f"--etcd={etcd.endpoint}",
        f"--port={free_port()}",
        "--http-port=-1",
        "--metrics-port=-1",
        f"--api-keys-file={key_file(tmp)}",
        "--log-level=WARNING",
    ]
    if mode in ("admission", "reserve"):
        args += ["--admission", *extra.split()]
    elif mode not in ("off", "calibrate"):
        raise ValueError(f"unknown router mode {mode!r}; use admission, reserve or off")
    router = await spawn("services.router.main", args, tmp / f"router-{mode}.log", "KVMESH_")
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            models = await stub.ListModels(
                router_pb2.ListModelsRequest(),
                metadata=(("authorization", "Bearer sk-interactive"),),
                timeout=5,
            )
            if models.models and models.models[0].workers == n:
                return router
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the router does not see {n} workers")


# ---- the load ---------------------------------------------------------------------------------
class Load:
    """Sends requests on one channel and records what each got."""

    def __init__(self, stub: router_pb2_grpc.RouterStub, timeout_s: float, seed: int) -> None:
        self.stub = stub
        self.timeout_s = timeout_s
        self.seed = seed
        self.t0 = time.monotonic()
        self.results: list[Result] = []
        self._n: dict[str, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, load: TenantLoad) -> Result:
        i = self._n[load.name] = self._n.get(load.name, 0) + 1
        sent = self.now()
        first: float | None = None
        call = self.stub.Generate(
            make_request(load.prompt(i, self.seed), max_tokens=load.output_tokens, ignore_eos=True),
            metadata=(("authorization", f"Bearer sk-{load.name}"),),
            timeout=self.timeout_s,
        )
        try:
            async for msg in call:
                if first is None and (msg.token_ids or msg.HasField("finished")):
                    first = self.now() - sent
                if msg.HasField("finished"):
                    u = msg.finished.usage
                    r = Result(
                        load.name,
                        sent,
                        self.now(),
                        OK,
                        first,
                        u.prompt_tokens,
                        u.cached_prompt_tokens,
                        u.completion_tokens,
                        engine_queue_s=u.queue_time_s,
                        engine_prefill_s=u.prefill_time_s,
                    )
                    break
            else:
                r = Result(load.name, sent, self.now(), FAILED, detail="no final message")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                trailers = {k: v for k, v in exc.trailing_metadata() or ()}
                retry = trailers.get("retry-after")
                later = ("made room", "pre-empted", "(the queue TTL)")  # core/admission.py
                details = exc.details() or ""
                r = Result(
                    load.name,
                    sent,
                    self.now(),
                    REJECTED,
                    retry_after_s=float(retry) if retry else None,
                    detail=AFTER_WAIT if any(w in details for w in later) else ARRIVAL,
                )
            else:
                r = Result(load.name, sent, self.now(), FAILED, detail=code.name)
        self.results.append(r)
        return r

    async def open_loop(self, loads: Sequence[TenantLoad]) -> None:
        """Sends every load's requests at their times (from now), then waits for them all."""
        plan = sorted(((t, load) for load in loads for t in load.arrivals()), key=lambda p: p[0])
        start = self.now()
        tasks = []
        for t, load in plan:
            delay = start + t - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self.one(load)))
        await asyncio.gather(*tasks)


async def settle(workers: Sequence[Proc], timeout_s: float = 60.0) -> None:
    """Waits until no worker runs or queues anything (the previous phase's requests)."""
    channels = [grpc.aio.insecure_channel(w.address) for w in workers]
    stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            loads = await asyncio.gather(
                *(s.GetLoad(worker_pb2.GetLoadRequest(), timeout=2) for s in stubs)
            )
            if all(ld.in_flight_requests == 0 for ld in loads):
                return
            await asyncio.sleep(0.2)
    finally:
        for c in channels:
            await c.close()


async def busy_share(workers: Sequence[Proc], seconds: float, every_s: float = 0.1) -> list[float]:
    """Per worker, the share of samples with a running request over ``seconds``."""
    channels = [grpc.aio.insecure_channel(w.address) for w in workers]
    stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
    busy = [0] * len(workers)
    total = [0] * len(workers)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            loads = await asyncio.gather(
                *(s.GetLoad(worker_pb2.GetLoadRequest(), timeout=2) for s in stubs),
                return_exceptions=True,
            )
            for i, ld in enumerate(loads):
                if isinstance(ld, worker_pb2.WorkerLoad):
                    total[i] += 1
                    busy[i] += 1 if ld.running_requests > 0 else 0
            await asyncio.sleep(every_s)
    finally:
        for c in channels:
            await c.close()
    return [b / t if t else math.nan for b, t in zip(busy, total, strict=True)]


# ---- the run ----------------------------------------------------------------------------------
def tenants(a: argparse.Namespace, capacity_per_s: float) -> dict[str, TenantLoad]:
    lead = 1.0  # the burst starts this long into the phase
    phase = a.burst_s + 2 * lead
    v = getattr(a, "vocab", VOCAB)
    return {
        "interactive": TenantLoad(
            "interactive", 10, 512, 64, 16, a.interactive_rate, 0, phase, vocab=v
        ),
        "batch": TenantLoad(
            "batch", 0, 1024, 512, 16, a.burst_x * capacity_per_s, lead, a.burst_s, vocab=v
        ),
        "flood": TenantLoad(
            "flood", 0, 0, 1024, 16, a.flood_x * capacity_per_s, lead, a.burst_s, vocab=v
        ),
    }


async def measure_capacity(
    a: argparse.Namespace, etcd: LocalEtcd, workers: list[Proc], tmp: Path
) -> float:
    """Batch requests per second the fleet answers, measured: ``--calibrate-concurrency``
    batch-shaped requests per worker kept in flight for ``--calibrate-s`` through a router
    without flow control (the shared prefix cached first, a fresh tail per request)."""
    router = await start_router(etcd, tmp, "calibrate", "", a.workers)
    batch = tenants(a, 1.0)["batch"]
    try:
        async with grpc.aio.insecure_channel(router.address) as ch:
            load = Load(router_pb2_grpc.RouterStub(ch), a.request_timeout_s, a.seed + 1)
            await asyncio.gather(*(load.one(batch) for _ in workers))  # the prefix, cached
            load.results.clear()
            end = load.now() + a.calibrate_s

            async def loop() -> None:
                while load.now() < end:
                    await load.one(batch)

            t0 = load.now()
            await asyncio.gather(*(loop() for _ in range(a.calibrate_concurrency * a.workers)))
            done = [r for r in load.results if r.status == OK]
            elapsed = load.now() - t0
    finally:
        await stop(router)
        await settle(workers)
    if not done:
        raise RuntimeError(f"no batch request answered while calibrating; see {tmp}")
    return len(done) / elapsed


def capacity_per_s(a: argparse.Namespace) -> float:
    """The fleet's capacity in batch requests per second, from the simulator's model: each
    engine step spends its token budget on prefill chunks and one token per decoding request,
    so a request costs its uncached prompt tokens plus its output tokens at the prefill rate
    (an upper bound: step overheads and attention come on top; the burst phase's answered
    requests per second say what the fleet really did)."""
    batch = tenants(a, 1.0)["batch"]
    per_request_s = SimWorkerConfig().prefill_s_per_token * (batch.new_tokens + batch.output_tokens)
    return a.workers * a.sim_speedup / per_request_s


async def run_mode(
    a: argparse.Namespace,
    etcd: LocalEtcd,
    workers: list[Proc],
    tmp: Path,
    mode: str,
    capacity: float,
) -> dict[str, Any]:
    extra = a.router_args
    if a.engine == "simulated" and "--admission-prefill-s-per-token" not in extra:
        # The simulated engine's real prefill speed, until the workers' reports teach the router
        # theirs (as an operator configures it): at the default (an H100-class 5e-5 s/token)
        # the router would price the burst's first second 1/speedup too cheap and let it all in.
        speed = SimWorkerConfig().prefill_s_per_token / a.sim_speedup
        extra += f" --admission-prefill-s-per-token {speed:g}"
    if mode == "reserve":
        profile = reserve_profile(tmp, a.reserve_workers, a.reserve_lend_after_idle_s)
        extra += f" --policy {profile}"
    router = await start_router(etcd, tmp, mode, extra, a.workers)
    plan = tenants(a, capacity)
    lead = plan["batch"].start_s
    try:
        async with grpc.aio.insecure_channel(router.address) as ch:
            load = Load(router_pb2_grpc.RouterStub(ch), a.request_timeout_s, a.seed)
            # Every tenant's shared prefix cached on every worker, as in a running mesh.
            await asyncio.gather(
                *(load.one(replace(plan[t], rate_per_s=1)) for t in plan for _ in workers)
            )
            await settle(workers)
            rows: list[TenantRow] = []
            load.results.clear()
            t0 = load.now()
            await load.open_loop([plan["interactive"]])
            alone = [replace(r, sent_s=r.sent_s - t0) for r in load.results]
            rows += summarize("alone", alone, plan["interactive"].duration_s)
            await settle(workers)
            load.results.clear()
            t1 = load.now()
            busy = asyncio.ensure_future(_after(lead, busy_share(workers, a.burst_s)))
            lag = asyncio.ensure_future(_after(lead, loop_lag(a.burst_s)))
            await load.open_loop(list(plan.values()))
            burst = [replace(r, sent_s=r.sent_s - t1, end_s=r.end_s - t1) for r in load.results]
            in_burst = [
                r for r in burst if r.tenant != "interactive" or lead <= r.sent_s < lead + a.burst_s
            ]
            rows += summarize("burst", in_burst, a.burst_s)
            per_worker_busy = await busy
            client_lag = await lag
            if a.results_jsonl is not None:
                with a.results_jsonl.open("a") as f:
                    for phase, rs in (("alone", alone), ("burst", burst)):
                        for r in rs:
                            f.write(json.dumps({"mode": mode, "phase": phase, **asdict(r)}))
                            f.write("\n")
    finally:
        await stop(router)
        await settle(workers)
    p99 = {row.phase: row.ttft_p99_s for row in rows if row.tenant == "interactive"}
    reserved = a.reserve_workers if mode == "reserve" else 0
    low = ("batch", "flood")
    shares = [served_between(burst, t, lead, lead + a.burst_s) for t in low]
    handed = [served_between(burst, t, lead, lead + a.burst_s, handed_off=True) for t in low]
    phase_shares = [served_between(burst, t, 0.0, math.inf) for t in low]
    rejected = [r for r in burst if r.status == REJECTED]
    failed: dict[str, int] = {}
    for r in [*alone, *burst]:
        if r.status == FAILED:
            key = f"{r.tenant}:{r.detail}"
            failed[key] = failed.get(key, 0) + 1
    return {
        "failed": failed,
        "mode": mode,
        "capacity_per_s": capacity,
        "rows": rows,
        "interactive_p99_ratio": p99.get("burst", math.nan) / p99.get("alone", math.nan),
        "jain_batch_flood_uncached": jain(shares),
        "uncached_batch_flood": shares,
        # The same over what the router handed to engines in the burst's window (the admission's
        # own fairness, without the engines' prefill times), and over the whole phase.
        "jain_batch_flood_handed_off": jain(handed),
        "jain_batch_flood_phase": jain(phase_shares),
        "fleet_busy": sum(per_worker_busy) / len(per_worker_busy),
        # The workers the reserve filter keeps (sim-00 ...: the first by worker id), the rest.
        "reserved_busy": _mean(per_worker_busy[:reserved]),
        "shared_busy": _mean(per_worker_busy[reserved:]),
        "client_loop_lag_p99_s": percentile(client_lag, 99),
        "reject_p99_s": percentile(
            [r.end_s - r.sent_s for r in rejected if r.detail == ARRIVAL], 99
        ),
        "retry_after_p50_s": percentile(
            [r.retry_after_s for r in rejected if r.retry_after_s is not None], 50
        ),
    }


async def loop_lag(seconds: float, every_s: float = 0.01) -> list[float]:
    """How late this process's event loop wakes a 10 ms sleep, over ``seconds``: the load
    generator's own delay, which every latency it measures includes."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        await asyncio.sleep(every_s)
        out.append(time.monotonic() - t - every_s)
    return out


async def _after(delay_s: float, coro: Any) -> Any:
    await asyncio.sleep(delay_s)
    return await coro


async def _main(a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-priority-") as d:
        tmp = Path(d)
        if a.engine == "vllm":
            from kvmesh.models import resolve_model

            a.model_path = resolve_model(a.model)
            a.vocab = json.loads((a.model_path / "config.json").read_text())["vocab_size"]
        async with mesh(a, tmp) as (etcd, workers):
            if a.engine == "vllm":
                print("measuring the fleet's capacity ...", file=sys.stderr, flush=True)
                capacity = await measure_capacity(a, etcd, workers, tmp)
            else:
                capacity = capacity_per_s(a)
            for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
                print(f"running mode {mode} ...", file=sys.stderr, flush=True)
                out.append(await run_mode(a, etcd, workers, tmp, mode, capacity))
    return out


def run(a: argparse.Namespace) -> int:
    if a.floor:
        from .floor import main as floor_main

        print(floor_main())
        return 0
    reports = asyncio.run(_main(a))
    if a.json:
        for rep in reports:
            print(json.dumps({**rep, "rows": [asdict(r) for r in rep["rows"]]}))
        return 0
    first = reports[0]
    fleet = (
        f"{a.workers} vLLM workers ({a.model}) x {a.sim_max_running} running; capacity "
        f"{first['capacity_per_s']:.1f} batch requests/s (measured)"
        if a.engine == "vllm"
        else f"{a.workers} simulated workers x {a.sim_max_running} running, speedup "
        f"{a.sim_speedup}; capacity ~{first['capacity_per_s']:.1f} batch requests/s"
    )
    print(
        f"fleet: {fleet}; batch at "
        f"{a.burst_x:g}x, flood at {a.flood_x:g}x for {a.burst_s:g} s; interactive "
        f"{a.interactive_rate:g}/s"
    )
    for rep in reports:
        print(f"\n## router: {rep['mode']}\n")
        print(format_rows(rep["rows"]))
        print(
            f"\ninteractive TTFT p99 burst / alone: {rep['interactive_p99_ratio']:.2f}x; "
            f"Jain (batch, flood) uncached tokens during the burst: "
            f"{rep['jain_batch_flood_uncached']:.3f} ({rep['uncached_batch_flood'][0]:,} vs "
            f"{rep['uncached_batch_flood'][1]:,}; handed to engines in the burst "
            f"{rep['jain_batch_flood_handed_off']:.3f}, over the phase "
            f"{rep['jain_batch_flood_phase']:.3f}); fleet busy {rep['fleet_busy']:.0%}"
            + (
                f" (reserved workers {rep['reserved_busy']:.0%}, the others "
                f"{rep['shared_busy']:.0%})"
                if not math.isnan(rep["reserved_busy"])
                else ""
            )
            + "; "
            f"429 at arrival p99 {_ms(rep['reject_p99_s'])}, Retry-After p50 "
            f"{_ms(rep['retry_after_p50_s'])} (the load generator's own loop lag p99 "
            f"{_ms(rep['client_loop_lag_p99_s'])})"
            + (f"; failed: {rep['failed']}" if rep["failed"] else "")
        )
    return 0


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"
