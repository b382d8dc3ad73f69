"""`arborspec serve --ray --replicas N`: the same OpenAI-compatible app, scaled out on Ray Serve.

Role in one decode step: none of its own. Each replica is a Ray actor process that opens its own
engines (`Generator.from_export`) into a pool and runs `create_app`'s FastAPI app
(tools/serve/app.py) unchanged; Ray's HTTP proxy takes the requests and its router balances them
over the replicas. Every response carries `x-arborspec-replica: PID` (the replica's process id).

Two ways to start it:
    arborspec serve --export-dir DIR --ray --replicas 2 [--host 127.0.0.1] [--port 8000]
    RAY_USAGE_STATS_ENABLED=0 serve run arborspec.tools.serve.ray_serve:app_builder export_dir=DIR replicas=2
`arborspec serve --ray` starts a local-only Ray (no dashboard, no usage reports, temp dir under
/tmp) and blocks until SIGINT/SIGTERM, then shuts Serve and Ray down.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

from arborspec.runtime import settings
from arborspec.runtime.errors import ArborspecError, InputError
from arborspec.tools.options import PREFIX_CACHE

REPLICA_HEADER = "x-arborspec-replica"
NEEDS_RAY = "arborspec serve --ray needs Ray Serve: pip install 'arborspec[ray]'"
_replica: dict = {}  # this process's app (one replica per Ray actor process)


class _ReplicaApp:
    """The ASGI app Ray's ingress runs: forwards to this process's app, tags the replica."""

    async def __call__(self, scope, receive, send):
        app = _replica["app"]
        if scope["type"] != "http":
            return await app(scope, receive, send)
        tag = (REPLICA_HEADER.encode(), str(os.getpid()).encode())

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), tag]}
            await send(message)

        await app(scope, receive, tagged)


class ArborspecReplica:
    """One replica: a generator pool over its own engines and the FastAPI app around it."""

    def __init__(
        self,
        export_dir,
        backend,
        device,
        draft,
        tree,
        workers,
        model_name,
        max_context,
        api_key,
        max_batch=1,
        prefix_cache=None,
        max_queue=None,
    ):
        from arborspec.runtime.backends.ort_loader import enable_shared_pool
        from arborspec.runtime.generator import Generator
        from arborspec.tools.serve.app import GeneratorPool, create_app

        # a replica is a process of its own that opens only these sessions: one shared ONNX
        # Runtime pool, as `arborspec serve` has (a pool per session made a model draft's
        # speculation slower than vanilla on the CPU: verify 9.5 vs 7.6 ms a call, 2026-11-27);
        # ARBORSPEC_ORT_SHARED_POOL=0 keeps a pool per session
        if backend in (None, "onnxruntime"):
            enable_shared_pool()
        self.pool = GeneratorPool(
            lambda: Generator.from_export(
                export_dir, backend, device, draft=draft, tree=tree, max_batch=max_batch, prefix_cache=prefix_cache
            ),
            workers,
            slots=max_batch,
        )
        _replica["app"] = create_app(
            self.pool, model_name, api_key=api_key, max_context=max_context, max_queue=max_queue
        )

    def __del__(self):
        self.pool.close()


def build(
    export_dir,
    *,
    replicas: int = 1,
    backend: str = "onnxruntime",
    device: str = "cpu",
    draft: str | None = None,
    tree: str | None = None,
    workers: int = 1,
    model_name: str | None = None,
    api_key: str | None = None,
    max_batch: int = 8,
    prefix_cache: bool | None = None,
    max_queue: int | None = 256,
):
    """The Ray Serve application: `replicas` copies of ArborspecReplica, each given
    min(1, cores / replicas) CPUs (so N replicas never wait for cores Ray does not see).
    max_queue: per replica, the sequences that may wait beyond its slots before a request gets
    503 (`arborspec serve --max-queue`; None: no limit)."""
    from ray import serve

    from arborspec.runtime.contract import read_manifest
    from arborspec.tools.serve.app import served_model_name

    if int(replicas) < 1:
        raise InputError(f"--replicas must be >= 1, got {replicas}")
    if int(workers) < 1:
        raise InputError(f"--workers must be >= 1, got {workers}")
    if int(max_batch) < 1:
        raise InputError(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue is not None and int(max_queue) < 0:
        raise InputError(f"--max-queue must be >= 0 (or -1: no limit), got {max_queue}")
    export_dir = Path(export_dir).expanduser().resolve()
    man = read_manifest(export_dir)  # a bad folder is one line here, not N failing replicas
    name = model_name or served_model_name(man.data, export_dir)
    cpus = min(1.0, (os.cpu_count() or 1) / int(replicas))
    deployment = serve.deployment(serve.ingress(_ReplicaApp())(ArborspecReplica), name="arborspec")
    return deployment.options(num_replicas=int(replicas), ray_actor_options={"num_cpus": cpus}).bind(
        str(export_dir),
        backend,
        device,
        draft,
        tree,
        int(workers),
        str(name),
        int(man.limits.get("max_context", 2048)),
        api_key or settings.text("ARBORSPEC_API_KEY"),
        int(max_batch),
        prefix_cache,
        None if max_queue is None else int(max_queue),
    )


def app_builder(args: dict):
    """`serve run arborspec.tools.serve.ray_serve:app_builder export_dir=DIR [replicas=N] [backend=...]
    [device=...] [draft=...] [tree=...] [workers=N] [max_batch=N] [max_queue=N] [model_name=...] [api_key=...]`
    (max_queue=-1: no limit)."""
    args = dict(args)
    if "export_dir" not in args:
        raise InputError("serve run arborspec.tools.serve.ray_serve:app_builder needs export_dir=DIR")
    for key in ("replicas", "workers", "max_batch", "max_queue"):
        if key in args:
            args[key] = int(args[key])
    if args.get("max_queue", 0) < 0:
        args["max_queue"] = None
    return build(args.pop("export_dir"), **args)


# Ray Serve's start-up waits, sized for a machine whose cores are busy with other work. Serve's
# controller gives its HTTP proxy actor 5 s to report ready, then kills and restarts it, and
# `serve.start` waits a fixed 60 s for the first one: on 2 loaded cores the proxy's Python start-up
# alone can take longer, so the driver's wait was cancelled with the actor (tests/tools/test_serve_ray.py
# errored at setup). The controller, a Ray actor, reads these variables from the environment it
# inherits from `ray.init`; `start` then waits for the proxy itself, up to ARBORSPEC_RAY_START_TIMEOUT_S.
RAY_SERVE_SLOW_START = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",  # Ray's default 5 (x restarts)
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",  # Ray's default 10 (3 misses restart the proxy)
}


def start_local_ray() -> None:
    """A local-only Ray: a new cluster on this machine, no dashboard, no usage reports."""
    import ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    for key, value in RAY_SERVE_SLOW_START.items():
        os.environ.setdefault(key, value)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # our own line says where it serves
    ray.init(
        address="local",
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=os.path.join(tempfile.gettempdir(), "ray"),
        object_store_memory=128 * 1024**2,
        log_to_driver=False,
        logging_level="warning",
    )


def start(app, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Start Serve's HTTP proxy on host:port and deploy `app` at / (blocks until both are up)."""
    import ray
    from ray import serve

    deadline = time.monotonic() + settings.number("ARBORSPEC_RAY_START_TIMEOUT_S")
    try:
        serve.start(http_options={"host": host, "port": port})
    except (TimeoutError, ray.exceptions.RayError):
        pass  # its fixed 60 s wait for the proxy ran out (a busy machine); the controller keeps starting it
    try:
        serve.run(app, name="arborspec", route_prefix="/")
    except Exception as e:  # a replica that cannot open its engines: one line, not Ray's report
        raise ArborspecError(f"the Ray Serve deployment did not start: {_replica_error(e)}") from None
    _wait_for_proxies(host, port, deadline)


def _wait_for_proxies(host: str, port: int, deadline: float) -> None:
    """Until every Serve HTTP proxy reports HEALTHY; past the deadline, one line saying why."""
    from ray import serve

    while True:
        proxies = {str(v.value if hasattr(v, "value") else v) for v in serve.status().proxies.values()}
        if proxies == {"HEALTHY"}:
            return
        if time.monotonic() > deadline:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            raise ArborspecError(
                f"Ray Serve's HTTP proxy on {host}:{port} did not start in time (proxy status: "
                f"{', '.join(sorted(proxies)) or 'none yet'}; load average {load:.1f} on {os.cpu_count()} cores): "
                "set ARBORSPEC_RAY_START_TIMEOUT_S (seconds, default 300) to wait longer on a busy machine"
            )
        time.sleep(0.5)


def _replica_error(e: Exception) -> str:
    """The last line of a replica's traceback (Serve's deployment status holds it), else Serve's."""
    from ray import serve

    try:
        texts = [d.message for d in serve.status().applications["arborspec"].deployments.values() if d.message]
    except Exception:  # noqa: BLE001 - the status is only a better message
        texts = []
    lines = [ln.strip() for ln in "\n".join([*texts, str(e)][:1]).splitlines() if ln.strip()]
    return re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1]) if lines else type(e).__name__


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run(args) -> int:
    """`arborspec serve --ray`: deploy, serve until SIGINT/SIGTERM, shut down."""
    if args.replicas < 1:
        raise InputError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_queue < -1:
        raise InputError(f"--max-queue must be >= 0 (or -1: no limit), got {args.max_queue}")
    if not 1 <= args.port <= 65535:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise InputError(NEEDS_RAY) from None
    app = build(
        args.export_dir,
        replicas=args.replicas,
        backend=args.backend,
        device=args.device,
        draft=args.draft,
        tree=args.tree,
        workers=args.workers,
        max_batch=args.max_batch,
        model_name=args.model_name,
        api_key=args.api_key,
        prefix_cache=PREFIX_CACHE[args.prefix_cache],
        max_queue=None if args.max_queue < 0 else args.max_queue,
    )
    start_local_ray()
    done = threading.Event()  # after ray.init, which sets a SIGTERM handler of its own
    old = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start(app, args.host, args.port)
        print(f"arborspec: {args.replicas} replica(s) on Ray Serve at http://{args.host}:{args.port}", flush=True)
        while not done.wait(0.5):
            pass
    finally:
        stop()
        for s, h in old.items():
            signal.signal(s, h)
    return 0
