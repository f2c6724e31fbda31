"""The ``kvmesh`` command: run a mesh, talk to it, build the built-in models.

kvmesh up          run etcd + workers + a router in the foreground (Ctrl-C stops them all)
kvmesh demo        up, ask one question, print the streamed answer and usage, shut down
kvmesh generate    stream a completion from a running router
kvmesh status      the cluster at a glance: workers, kvmanagers, routers (from etcd)
kvmesh model       build a built-in model directory (tiny, smollm2)
kvmesh router      run one router process
kvmesh worker      run one worker process
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.cli_workers import dp_worker_args, speculative_config, speculative_worker_args
from kvmesh.models import MODEL_NAMES, ModelNotFound, resolve_model
from kvmesh.units import parse_bytes

if TYPE_CHECKING:  # kvmesh.tls imports grpc: the CLI imports it where a command needs it
    from kvmesh.tls import Tls

DEFAULT_ROUTER = "127.0.0.1:50051"
# Subcommands that run a service: (name, module with main(argv), help).
SERVICE_COMMANDS = {
    s[0]: s
    for s in (
        ("router", "services.router.main", "run one router process"),
        ("worker", "services.worker.main", "run one worker process"),
        ("kvmanager", "services.kvmanager.main", "run one kvmanager process"),
        ("node", "services.node.main", "run a router and a worker in one process"),
    )
}
# kvmesh.telemetry.Exporter's values, without importing grpc and OpenTelemetry to build the parser.
TRACE_EXPORTERS = ("none", "console", "otlp")
# Where OpenTelemetry's OTLP exporter finds its collector when --otlp-endpoint is empty.
OTLP_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


# ---- up / demo ------------------------------------------------------------------------------
def _add_mesh_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="built-in model (tiny, smollm2) or a local HF model dir (default %(default)s)",
    )
    p.add_argument(
        "--served-model-name", default="", help="name clients use (default: model dir name)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="number of workers doing both prefill and decode (default 2, or 0 with "
        "--prefill/--decode)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="prefill workers (--role prefill): long prompts are prefilled there and their KV "
        "handed to a decode worker through the kvmanager (default 0)",
    )
    p.add_argument(
        "--decode", type=int, default=0, help="decode workers (--role decode) (default 0)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=default_port,
        help="router gRPC port (default %(default)s; 0 = any free port)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=8000 if default_port else 0,
        help="router's OpenAI-compatible HTTP port (default %(default)s; 0 = any free port)",
    )
    p.add_argument(
        "--allowed-origins",
        default="",
        help="CORS origins allowed to call the HTTP API (JSON list or comma-separated; '*': "
        "any; default: none), as kvmesh router --allowed-origins",
    )
    p.add_argument("--allowed-methods", default="", help="CORS methods (default: all)")
    p.add_argument("--allowed-headers", default="", help="CORS request headers (default: all)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument(
        "--etcd", default="", help="etcd endpoints host:port,...; empty starts a local etcd"
    )
    p.add_argument("--cluster", default="default", help="etcd cluster name")
    p.add_argument(
        "--policy",
        type=policy_arg,
        default=None,
        metavar="NAME|FILE.yaml",
        help=f"the router's scheduler profile, as kvmesh router --policy: one of "
        f"{', '.join(sorted(_policies()))}, or a profile YAML file (default: the router's, "
        "precise-sticky)",
    )
    p.add_argument("--max-model-len", type=int, default=4096, help="context length in tokens")
    p.add_argument(
        "--kv-cache-bytes", type=int, default=256 << 20, help="KV cache per worker, bytes"
    )
    p.add_argument(
        "--kvmanager-cpu-bytes",
        type=parse_bytes,
        default=1 << 30,
        help="CPU KV tier of the node's kvmanager, which every worker saves to and loads from "
        "(default 1GiB; 0: no kvmanager)",
    )
    p.add_argument(
        "--kvmanager-disk-bytes",
        type=parse_bytes,
        default=0,
        help="its disk tier, in the log dir (default 0: none)",
    )
    p.add_argument(
        "--log-dir", type=Path, default=None, help="where child logs go (default: a temp dir)"
    )
    p.add_argument(
        "--colocate",
        choices=("auto", "on", "off"),
        default="off",
        help="run the first worker in the router's process (kvmesh node): the router's data path "
        "to it is then a call, not a gRPC stream, one process fewer per token (~15%% less CPU "
        "per token); the process going down takes both. auto: on for a mesh of one worker and "
        "one router process. Off by default: under vllm bench serve the separate processes "
        "gave the same throughput and a lower TTFT (docs/serving-cost.md) (default %(default)s)",
    )
    p.add_argument(
        "--router-processes",
        type=int,
        default=1,
        help="router processes sharing the router's ports (SO_REUSEPORT), each with its own "
        "KV index; one process uses one core (default %(default)s)",
    )
    p.add_argument(
        "--tls-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="mutual TLS on every hop with DIR's ca.pem, node.pem and node.key, made there when "
        "missing (needs the cryptography package; docs/deploy.md#tls) (default: plaintext)",
    )
    p.add_argument(
        "--no-cpu-binding",
        action="store_true",
        help="do not give each engine cores of its own (default: engines' compute threads are "
        "bound to their cores and one core is kept for router, kvmanager and front ends when "
        "there are enough; docs/architecture.md)",
    )
    p.add_argument(
        "--trace-exporter",
        default="none",
        choices=TRACE_EXPORTERS,
        help="tracing of every service (docs/tracing.md): none, console (spans in each child's "
        "log), otlp (default %(default)s)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default="",
        help="the OTLP/gRPC collector for --trace-exporter otlp: host:port, http://host:port or "
        "https://host:port (default: OTEL_EXPORTER_OTLP_ENDPOINT from the environment)",
    )
    spec = p.add_argument_group(
        "speculative decoding", "passed to the workers as kvmesh worker --spec-* (docs/engine.md)"
    )
    spec.add_argument(
        "--spec-method",
        default="",
        metavar="{ngram,draft_model,eagle,eagle3,mtp,none}",
        help="speculative decoding method of the workers (default: none)",
    )
    spec.add_argument(
        "--spec-num-tokens", type=int, default=0, help="tokens drafted per step (default: 3)"
    )
    spec.add_argument(
        "--spec-draft-model",
        default="",
        metavar="NAME|PATH",
        help="draft model (draft_model) or EAGLE head (eagle, eagle3): built-in tiny-draft "
        "(draft_model), tiny-eagle (eagle), tiny-eagle3 (eagle3) or a local HF model dir",
    )
    spec.add_argument("--spec-prompt-lookup-min", type=int, default=0, help="ngram: shortest match")
    spec.add_argument("--spec-prompt-lookup-max", type=int, default=0, help="ngram: longest match")
    spec.add_argument(
        "--spec-workers",
        type=int,
        default=-1,
        metavar="N",
        help="only the first N workers speculate, the rest decode plainly: a mixed fleet "
        "(default: all)",
    )
    dp = p.add_argument_group(
        "data-parallel ranks", "passed to every worker (docs/engine.md#data-parallel-ranks)"
    )
    dp.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel ranks per worker, each its own KV cache and routing target "
        "(default: 1)",
    )
    dp.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE experts sharded across each worker's data-parallel ranks (vLLM)",
    )
    p.set_defaults(mesh_parser=p)


def _policies() -> dict[str, str]:
    from services.router.core.routing import POLICIES  # the router's own registry of profiles

    return POLICIES


def policy_arg(value: str) -> str:
    """``--policy``: a built-in profile name (the router's registry), or an existing profile
    file, made absolute."""
    if value.endswith((".yaml", ".yml")):
        path = Path(value)
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"no profile file {value!r}")
        return str(path.resolve())
    if value not in _policies():
        raise argparse.ArgumentTypeError(
            f"unknown profile {value!r}; choose one of {', '.join(sorted(_policies()))} or give "
            "a profile file (.yaml)"
        )
    return value


def check_tracing(
    p: argparse.ArgumentParser, a: argparse.Namespace, environ: Mapping[str, str]
) -> None:
    """Usage errors in --trace-exporter / --otlp-endpoint, before any child starts: a mesh that
    silently exports nowhere is worse than a message."""
    if a.trace_exporter != "otlp":
        if a.otlp_endpoint:
            p.error("--otlp-endpoint needs --trace-exporter otlp")
        return
    if a.otlp_endpoint:
        from kvmesh.telemetry import otlp_target

        try:
            otlp_target(a.otlp_endpoint)
        except ValueError as exc:
            p.error(str(exc))
    elif not any(environ.get(name) for name in OTLP_ENDPOINT_ENV):
        p.error(
            "--trace-exporter otlp needs --otlp-endpoint HOST:PORT (e.g. localhost:4317), or "
            "OTEL_EXPORTER_OTLP_ENDPOINT in the environment"
        )


def _both_workers(a: argparse.Namespace) -> int:
    """Workers of role both; checks the P/D counts (exits with a message when they make no
    mesh)."""
    if a.prefill < 0 or a.decode < 0 or (a.workers is not None and a.workers < 0):
        sys.exit("kvmesh: --workers, --prefill and --decode must be >= 0")
    workers = a.workers if a.workers is not None else (0 if a.prefill or a.decode else 2)
    if a.prefill and not (a.decode or workers):
        sys.exit("kvmesh: --prefill needs a worker to decode on: add --decode N (or --workers N)")
    if a.prefill and a.kvmanager_cpu_bytes <= 0:
        sys.exit(
            "kvmesh: --prefill hands KV over through the kvmanager; keep --kvmanager-cpu-bytes > 0"
        )
    if workers + a.prefill + a.decode <= 0:
        sys.exit("kvmesh: no worker to start; use --workers N or --prefill N --decode M")
    return workers


def _describe_workers(spec) -> str:  # type: ignore[no-untyped-def]
    if spec.colocate:
        return "1 worker, in the router's process"
    if not (spec.prefill_workers or spec.decode_workers):
        return f"{spec.workers} workers"
    both = f" + {spec.workers} both" if spec.workers else ""
    return f"{spec.prefill_workers} prefill + {spec.decode_workers} decode workers{both}"


def _describe_tracing(spec) -> str:  # type: ignore[no-untyped-def]
    if spec.trace_exporter == "none":
        return ""
    if spec.trace_exporter == "console":
        return "  traces  console: in each child's log\n"
    return f"  traces  otlp: {spec.otlp_endpoint or 'the OTEL_EXPORTER_OTLP_* environment'}\n"


def describe_metrics(mesh) -> str:  # type: ignore[no-untyped-def]
    """Each child's Prometheus endpoint, as its ready line says (``metrics=``)."""
    children = [c for c in (mesh.router, mesh.kvmanager, *mesh.workers) if c is not None]
    urls = [(c.name, c.ready["metrics"]) for c in children if c.ready.get("metrics")]
    if not urls:
        return ""
    width = max(len(name) for name, _ in urls)
    lines = [f"{name:<{width}}  {url}" for name, url in urls]
    return "  metrics " + "\n          ".join(lines) + "\n"


def _colocate(a: argparse.Namespace) -> bool:
    """--colocate: auto is on for one worker (of any role) and one router process."""
    if a.colocate != "auto":
        if a.colocate == "on" and a.router_processes > 1:
            a.mesh_parser.error("--colocate on needs --router-processes 1")
        return bool(a.colocate == "on")
    return _both_workers(a) + a.prefill + a.decode == 1 and a.router_processes == 1


def _mesh_spec(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvmesh.launcher import MeshSpec

    model_path = resolve_model(a.model)
    return MeshSpec(
        model_path=model_path,
        spec_worker_args=speculative_worker_args(a.mesh_parser, a, model_path),
        spec_workers=a.spec_workers,
        worker_args=dp_worker_args(a.mesh_parser, a),
        # A built-in model is served under its short name (tiny, smollm2).
        served_model_name=a.served_model_name or (a.model if a.model in MODEL_NAMES else ""),
        workers=_both_workers(a),
        prefill_workers=a.prefill,
        decode_workers=a.decode,
        router_port=a.port,
        router_http_port=a.http_port,
        router_policy=a.policy or "",
        etcd_endpoints=tuple(e for e in a.etcd.split(",") if e),
        cluster=a.cluster,
        max_model_len=a.max_model_len,
        kv_cache_bytes=a.kv_cache_bytes,
        log_dir=a.log_dir,
        kvmanager_cpu_bytes=a.kvmanager_cpu_bytes,
        kvmanager_disk_bytes=a.kvmanager_disk_bytes,
        trace_exporter=a.trace_exporter,
        otlp_endpoint=a.otlp_endpoint,
        bind_cpus=not a.no_cpu_binding,
        router_processes=a.router_processes,
        colocate=_colocate(a),
        allowed_origins=a.allowed_origins,
        allowed_methods=a.allowed_methods,
        allowed_headers=a.allowed_headers,
        allow_credentials=a.allow_credentials,
        tls_dir=a.tls_dir.resolve() if a.tls_dir is not None else None,
    )


def cmd_up(a: argparse.Namespace) -> int:
    from kvmesh.launcher import Mesh

    t0 = time.monotonic()
    spec = _mesh_spec(a)
    workers = _describe_workers(spec)
    if a.nodes:  # no colocated router: it runs in the root namespace
        workers = f"{a.nodes} nodes (network namespaces), each {_describe_workers(replace(spec, colocate=False))}"
    print(
        f"kvmesh up: model {spec.model_path}, {workers}, logs in {a.log_dir or 'a temp dir'}",
        flush=True,
    )
    if a.nodes:
        from kvmesh.netns import NodesMesh

        mesh: Any = NodesMesh(spec, a.nodes, handle_signals=False)  # ours below call stop()
    else:
        mesh = Mesh(spec)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    mesh.start()
    files = mesh.tls_files()
    tls_flags = (
        f" --tls-ca-file {files[2]} --tls-cert-file {files[0]} --tls-key-file {files[1]}"
        if files
        else ""
    )
    print(
        f"kvmesh up: ready in {time.monotonic() - t0:.1f} s\n"
        f'  router  {mesh.router_address}   (try: kvmesh generate --router {mesh.router_address}{tls_flags} "Hello")\n'
        f"  openai  {mesh.http_base_url}   (OpenAI-compatible: base_url for any OpenAI client)\n"
        f"  etcd    {','.join(mesh.etcd_endpoints)}\n"
        f"  workers {', '.join(w.ready.get('address', '?') for w in mesh.workers)}\n"
        f"{mesh.describe() if a.nodes else ''}"
        f"  logs    {mesh.log_dir}\n"
        f"{describe_metrics(mesh)}"
        f"{_describe_tracing(spec)}"
        "Ctrl-C stops everything.",
        flush=True,
    )
    try:
        while not stop:
            dead = [c for c in [mesh.router, *mesh.workers] if c and c.proc.poll() is not None]
            if dead:
                print(
                    f"kvmesh up: {dead[0].name} exited (code {dead[0].proc.returncode}); stopping",
                    file=sys.stderr,
                )
                break
            time.sleep(0.5)
    finally:
        print("kvmesh up: stopping (router, then workers drain, then etcd)", flush=True)
        mesh.stop()
        print("kvmesh up: stopped", flush=True)
    return 0 if stop else 1


DEMO_QUESTION = "What is the capital of France? Answer in one short sentence."


def cmd_demo(a: argparse.Namespace) -> int:
    from kvmesh.client import RouterClient, make_request, usage_line
    from kvmesh.launcher import Mesh

    t0 = time.monotonic()
    spec = _mesh_spec(a)
    print(
        f"demo: starting etcd, a kvmanager, {spec.workers} vLLM workers ({spec.served_model_name or spec.model_path.name}) and a router ...",
        flush=True,
    )
    with Mesh(spec) as mesh:
        print(
            f"demo: mesh ready in {time.monotonic() - t0:.1f} s, router at {mesh.router_address}",
            flush=True,
        )

        async def ask() -> None:
            async with RouterClient(mesh.router_address, tls=mesh.client_tls()) as client:
                await client.wait_for_models()
                print(f"\nuser> {a.question}\nassistant> ", end="", flush=True)
                req = make_request(a.question, chat=True, max_tokens=a.max_tokens, temperature=0.0)
                c = await client.complete(
                    req, on_chunk=lambda ch: print(ch.text, end="", flush=True)
                )
                print(f"\n{usage_line(c)} total_ms={c.total_s * 1000:.0f}", flush=True)

        asyncio.run(ask())
        print("\ndemo: shutting the mesh down", flush=True)
    print("demo: done", flush=True)
    return 0


# ---- generate -------------------------------------------------------------------------------
def cmd_generate(a: argparse.Namespace) -> int:
    import grpc

    from kvmesh.client import RouterClient, make_request, usage_line

    if a.token_ids:
        prompt: object = [int(t) for t in a.prompt.replace(",", " ").split()]
    elif a.system:
        prompt = [{"role": "system", "content": a.system}, {"role": "user", "content": a.prompt}]
    else:
        prompt = a.prompt
    req = make_request(
        prompt,  # type: ignore[arg-type]
        chat=not a.raw,
        max_tokens=a.max_tokens,
        model=a.model,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        stop=a.stop,
        ignore_eos=a.ignore_eos,
        request_id=a.request_id,
        session_id=a.session_id,
        tenant=a.tenant,
        priority=a.priority,
    )

    async def run() -> int:
        key = a.api_key or os.environ.get("KVMESH_API_KEY", "")
        tls = _client_tls(a)
        async with RouterClient(
            a.router, max_attempts=a.max_attempts, api_key=key, tls=tls
        ) as client:
            try:
                c = await client.complete(
                    req,
                    timeout_s=a.timeout_s,
                    on_chunk=lambda ch: print(ch.text, end="", flush=True),
                )
            except grpc.aio.AioRpcError as exc:
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            print()
            print(usage_line(c), file=sys.stderr)
            return 0

    return asyncio.run(run())


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="stream a completion from a running router",
        description="Stream a completion from a running kvmesh router. The prompt is sent as one "
        "user chat message (the model's chat template applies) unless --raw or --token-ids.",
    )
    p.add_argument("prompt", help="the prompt text (or token ids with --token-ids)")
    p.add_argument(
        "--router",
        default=DEFAULT_ROUTER,
        help="router address host:port, several comma-separated (a:1,b:2), or dns:///NAME:PORT "
        "for every address of a DNS name; a router failing mid-request hands the request to the "
        "next (docs/failover.md) (default %(default)s)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        help="routers tried per request, the first included: a stream that breaks is retried "
        "or resumed on the next (default 3 with several routers or a dns:/// name, else 1)",
    )
    p.add_argument(
        "--api-key",
        default="",
        help="API key for a router that checks keys (--api-keys-file; docs/tenants.md); "
        "default: $KVMESH_API_KEY, else none",
    )
    p.add_argument("--model", default="", help="served model name (default: the only one served)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="most tokens to generate (default %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy; range [0, 2] (default: engine's, 1.0)",
    )
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, (0, 1]")
    p.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely tokens; -1 disables"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--system", default="", help="a system message before the prompt (chat mode)")
    p.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text, no chat template"
    )
    p.add_argument("--token-ids", action="store_true", help="the prompt is token ids, e.g. '1 2 3'")
    p.add_argument("--request-id", default="", help="request id (default: the router makes one)")
    p.add_argument("--session-id", default="", help="agent/conversation session id")
    p.add_argument("--tenant", default="", help="tenant for flow control")
    p.add_argument(
        "--priority", type=int, default=0, help="priority (higher first under contention)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="deadline for the whole request, seconds"
    )
    _add_tls_client_flags(p)
    p.set_defaults(func=cmd_generate)


def _add_tls_client_flags(p: argparse.ArgumentParser) -> None:
    """Flags of a client to TLS services (``kvmesh/tls.py``): the mesh's CA, and a client
    certificate for services that ask one (mutual TLS)."""
    g = p.add_argument_group("TLS (docs/deploy.md#tls)")
    g.add_argument("--tls-ca-file", type=Path, help="PEM CA the services' certificates chain to")
    g.add_argument("--tls-cert-file", type=Path, help="PEM client certificate (mutual TLS)")
    g.add_argument("--tls-key-file", type=Path, help="PEM private key of --tls-cert-file")
    g.add_argument(
        "--tls-server-name",
        default="",
        help="name the services' certificates carry, if not the host",
    )


def _client_tls(a: argparse.Namespace) -> Tls | None:
    """The TLS of ``_add_tls_client_flags``' flags; a bad file exits 2 with its name."""
    from kvmesh.errors import InvalidArgument
    from kvmesh.tls import TlsConfig

    try:
        return TlsConfig(
            cert_file=a.tls_cert_file,
            key_file=a.tls_key_file,
            ca_file=a.tls_ca_file,
            server_name=a.tls_server_name,
        ).load(serving=False)
    except InvalidArgument as exc:
        print(f"kvmesh: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_status(a: argparse.Namespace) -> int:
    import json

    from kvmesh.discovery.client import EtcdUnavailable
    from kvmesh.status import format_table, gather

    endpoints = [x.strip() for x in a.etcd.split(",") if x.strip()]
    try:
        status = asyncio.run(
            gather(endpoints, a.cluster, a.timeout_s, _client_tls(a), _etcd_credentials(a))
        )
    except (EtcdUnavailable, ValueError) as exc:
        print(f"kvmesh status: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(status.to_dict(), indent=2))
    else:
        print(format_table(status), end="")
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="the cluster at a glance: workers, kvmanagers, routers",
        description="Read the cluster's records from etcd and ask every service for its state "
        "(workers: load and cache hit rate; kvmanagers: tier fill; routers: health). A service "
        "that does not answer shows as unreachable. Exit code 0 if etcd answered, else 1.",
    )
    p.add_argument(
        "--etcd",
        default="127.0.0.1:2379",
        metavar="ENDPOINTS",
        help="etcd host:port,... (default %(default)s)",
    )
    p.add_argument("--cluster", default="default", help="cluster name (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts) instead of tables")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=2.0,
        help="deadline for etcd and for each service, seconds (default %(default)s)",
    )
    _add_tls_client_flags(p)
    g = p.add_argument_group("etcd TLS and user (docs/etcd.md#tls-and-authentication)")
    g.add_argument("--etcd-ca-file", type=Path, help="PEM CA of etcd's certificate: TLS")
    g.add_argument("--etcd-cert-file", type=Path, help="PEM client certificate for etcd")
    g.add_argument("--etcd-key-file", type=Path, help="PEM private key of --etcd-cert-file")
    g.add_argument("--etcd-server-name", default="", help="name in etcd's certificate")
    g.add_argument(
        "--etcd-user",
        default="",
        help="etcd user; its password from --etcd-password-file or $KVMESH_ETCD_PASSWORD",
    )
    g.add_argument("--etcd-password-file", type=Path, help="file holding --etcd-user's password")
    p.set_defaults(func=cmd_status)


def _etcd_credentials(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The etcd TLS and user of ``kvmesh status``' flags; a bad file exits 2 naming it."""
    from kvmesh.discovery.security import EtcdSecurity
    from kvmesh.errors import InvalidArgument

    try:
        security = EtcdSecurity(
            ca_file=a.etcd_ca_file,
            cert_file=a.etcd_cert_file,
            key_file=a.etcd_key_file,
            server_name=a.etcd_server_name,
            user=a.etcd_user,
            password=os.environ.get("KVMESH_ETCD_PASSWORD", "")
            if a.etcd_user and a.etcd_password_file is None
            else "",
            password_file=a.etcd_password_file,
        )
        return security.load()
    except InvalidArgument as exc:
        print(f"kvmesh status: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a mesh in the foreground until Ctrl-C")
    _add_mesh_flags(up, default_port=50051)
    up.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="N nodes on this machine, each a network namespace with its own address, kvmanager "
        "and --workers (root; kvmesh/netns.py, docs/deploy.md); 0: one node, no namespaces",
    )
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser("demo", help="start a mesh, ask it a question, shut it down")
    _add_mesh_flags(demo, default_port=0)
    demo.add_argument("--question", default=DEMO_QUESTION)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)

    _add_generate(sub)
    _add_status(sub)

    from kvmesh.models import cli as model_cli

    model_cli.register(sub)

    from services.router import keycli

    keycli.register(sub)

    from benchmarks.replay import cli as replay_cli

    replay_cli.register(sub)

    for name, module, what in SERVICE_COMMANDS.values():
        p = sub.add_parser(
            name,
            help=f"{what} (see kvmesh {name} --help)",
            add_help=False,
            prefix_chars="\0",  # every argument, --flags included, goes to the service's parser
        )
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(
            func=lambda a, module=module: __import__(module, fromlist=["main"]).main(a.args)
        )
    return parser


def parse_args(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The command line, parsed and checked across flags (``environ``: default os.environ)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    mesh_parser = getattr(args, "mesh_parser", None)
    if mesh_parser is not None:  # kvmesh up / demo
        check_tracing(mesh_parser, args, os.environ if environ is None else environ)
        speculative_config(mesh_parser, args)  # the model checks wait for the models
    return args


def main(argv: list[str] | None = None) -> int:
    import logging

    args = parse_args(argv)
    # The services set up logging themselves, at their --log-level; configuring the root logger
    # first would make theirs a no-op (basicConfig), and `kvmesh kvmanager` (the image's
    # entrypoint) then logged nothing below WARNING.
    if args.command not in SERVICE_COMMANDS:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ModelNotFound as exc:
        raise SystemExit(f"kvmesh: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
