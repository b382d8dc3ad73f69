"""`arborspec serve`: an OpenAI-compatible HTTP server over an export folder.

Role in one decode step: none of its own; each request is one generation (tools/serve/app.py).
"""

from __future__ import annotations

import errno
import socket
import sys

from arborspec.runtime import settings
from arborspec.runtime.errors import InputError
from arborspec.tools.commands.options import add_export_dir_arg, add_prefix_cache_arg, add_tree_arg, command_parser
from arborspec.tools.options import DEVICE_HELP, DRAFT_HELP_EXPORT, PREFIX_CACHE

EXAMPLE = """examples:
  arborspec serve --export-dir ~/.cache/arborspec/exports/smollm2-135m-layers4-v2 --draft lookup --port 8000
  curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
  arborspec serve --export-dir DIR --host 0.0.0.0 --api-key "$KEY" --max-batch 8
  arborspec serve --export-dir DIR --ray --replicas 2   # Ray Serve: 2 replicas, each with its own engines
defaults: a request without "temperature" samples at 1.0, OpenAI's default (`arborspec generate` is
greedy by default): send "temperature": 0 for the greedy answer. A chat/instruct model answers
/v1/completions (raw text, no chat template) with a token or two: use /v1/chat/completions.
The server prints one line when it listens (URL, model id, draft, tree, batch), one line per request
(method, path, status, generated tokens, ms; --quiet: none) and one when it stops.
"""


def register(sub) -> None:
    p = command_parser(
        sub, "serve", "OpenAI-compatible HTTP server (completions, chat, SSE, metrics)", __doc__, EXAMPLE
    )
    add_export_dir_arg(p)
    p.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default="onnxruntime", help="default onnxruntime")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--draft", default=None, help=DRAFT_HELP_EXPORT)
    add_tree_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="sequences decoded together, one verify call per step for all (default 8; 1: one at a time)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="generators (each with its engines and --max-batch sequences; default 1; more requests queue)",
    )
    add_prefix_cache_arg(
        p,
        "reuse the K/V of a prompt's start that the previous prompt shared (a chat's earlier turns, a "
        "system prompt): auto (default) = where that is exact (a row-invariant target, the int4 export), on, off",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="sequences that may wait beyond workers x max-batch; a request past it gets 503 + Retry-After "
        "(default 256; -1: no limit)",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $ARBORSPEC_API_KEY)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the export's name)")
    p.add_argument("--ray", action="store_true", help="run on Ray Serve (pip install 'arborspec[ray]')")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: replicas, each with its own engines")
    p.add_argument("--quiet", action="store_true", help="no per-request log lines")
    p.set_defaults(run=run)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads: a port in use (or an address this
    machine does not have) is one line, not a traceback after a minute of loading."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (another server is there: pick another --port)" if e.errno == errno.EADDRINUSE else ""
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def _say(line: str) -> None:
    sys.stderr.write(f"arborspec: {line}\n")
    sys.stderr.flush()


def run(args) -> int:
    if args.ray:
        from arborspec.tools.serve.ray_serve import run as run_on_ray

        return run_on_ray(args)
    if args.replicas != 1:
        raise InputError("--replicas needs --ray (without Ray, --workers sets the concurrency)")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise InputError("arborspec serve needs FastAPI and uvicorn: pip install 'arborspec[serve]'") from None
    if not 1 <= args.port <= 65535:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    if args.workers < 1:
        raise InputError(f"--workers must be >= 1, got {args.workers}")
    if args.max_batch < 1:
        raise InputError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_queue < -1:
        raise InputError(f"--max-queue must be >= 0 (or -1: no limit), got {args.max_queue}")
    sock = _bind(args.host, args.port)  # first: a port clash is one line, before anything loads
    try:
        from arborspec.runtime.contract import read_manifest

        return _serve(args, read_manifest(args.export_dir), sock, uvicorn)
    finally:
        sock.close()


def _serve(args, man, sock, uvicorn) -> int:
    from arborspec.runtime.generator import Generator
    from arborspec.tools.serve.app import GeneratorPool, create_app, served_model_name

    name = args.model_name or served_model_name(man.data, args.export_dir)
    pool = GeneratorPool(
        lambda: Generator.from_export(
            args.export_dir,
            args.backend,
            args.device,
            draft=args.draft,
            tree=args.tree,
            max_batch=args.max_batch,
            prefix_cache=PREFIX_CACHE[args.prefix_cache],
        ),
        args.workers,
        slots=args.max_batch,
    )
    try:
        app = create_app(
            pool,
            str(name),
            api_key=args.api_key or settings.text("ARBORSPEC_API_KEY"),
            max_context=int(man.limits.get("max_context", 2048)),
            access_log=None if args.quiet else _say,
            max_queue=None if args.max_queue < 0 else args.max_queue,
        )
        g = pool.all[0]
        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"http://{host}:{args.port}"
        draft = "none" if g.draft is None else (args.draft or "export")
        tree = g.tree if g.mode != "vanilla" else "-"
        if g.mode != "vanilla" and g.sampled_tree and args.max_batch == 1:  # `tune --temperature` ran
            tree += f", at temperature > 0 {g.sampled_tree}"
        sock.listen(2048)
        if args.host not in ("127.0.0.1", "localhost", "::1") and not (
            args.api_key or settings.text("ARBORSPEC_API_KEY")
        ):
            _say(f"warning: listening on {args.host} without --api-key: anyone who can reach the port can use it")
        _say(
            f"serving {name} on {url} (draft {draft}, mode {g.mode}, tree {tree}, batch {args.max_batch}, "
            f"workers {args.workers}, prefix cache {'on' if g.reuses_prefix else 'off'}; "
            "requests default to temperature 1.0; Ctrl-C stops)"
        )
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # a second Ctrl-C, or uvicorn re-raising the first
            pass
        _say(f"stopped serving on {url}")
    finally:
        pool.close()
    return 0
