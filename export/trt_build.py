"""TensorRT engine build from a contract ONNX graph (`tensorrt` 10.x/11.x or `tensorrt_rtx`).

Role in one decoding step: none at run time. This turns `target.onnx` / `draft.onnx` into
serialized engines whose optimisation profiles cover every call the decode loop makes: a
*decode/tree* profile (T = 1..max_tree_nodes+1 new tokens over P = 0..max_context-1 cached
positions: draft levels and the target's single verify call) and a *prefill* profile (T up to
max_context: prompts, chunked prefills). `arborspec.runtime.backends.tensorrt.TrtEngine`
picks the profile that covers each call's (B, T, P) and binds the KV cache by address.

One code path for both Python modules: `tensorrt` is preferred when importable, otherwise
`tensorrt_rtx`; `ARBORSPEC_TRT_MODULE=tensorrt|tensorrt_rtx` (or `flavour=`) forces one.
Networks are strongly typed (precision comes from the ONNX; no FP16/INT8 builder flags).
With tensorrt_rtx, engines can be built ahead of time on a machine without a GPU for a named
compute capability ("8.9" -> ComputeCapability.SM89).

Next to each engine: `engines.json` (profiles with min/opt/max shapes per input, I/O names and
dtypes, TensorRT flavour and version, compute capability, source ONNX sha256) and the build
cache: `<engine>.timing.cache` (TensorRT; reused by the next build) or, for TensorRT-RTX whose
timing cache is a no-op, the path of the runtime (JIT kernel) cache that TrtEngine fills and
saves on the GPU (`<engine>.runtime.cache`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from arborspec.runtime import contract as C
from arborspec.runtime.errors import EngineError, MissingFileError
from arborspec.runtime.fileio import atomic_write_bytes, atomic_write_json, sha256_file

MANIFEST_NAME = C.ENGINES_NAME
MANIFEST_FORMAT = C.ENGINES_FORMAT
ENV_MODULE = "ARBORSPEC_TRT_MODULE"

IDS, POS, MASK = C.INPUT_IDS, C.POSITION_IDS, C.ATTENTION_MASK
_PAST_RE = re.compile(r"^past_(key|value)\.(\d+)$")


class TensorRTNotInstalled(EngineError, ImportError):
    """Neither `tensorrt` nor `tensorrt_rtx` can be imported (message says how to install)."""


class EngineBuildError(EngineError):
    """A build that cannot proceed: bad limits, an unsupported compute capability, an ONNX the
    parser rejects, a failed build. The first line of the message is self-contained."""


# --------------------------------------------------------------------------- module choice


def import_tensorrt(flavour: str = "auto"):
    """(module, flavour) for `flavour` in auto|tensorrt|tensorrt_rtx; env ARBORSPEC_TRT_MODULE
    overrides auto. auto prefers `tensorrt` when importable, else `tensorrt_rtx`."""
    from arborspec.runtime.backends.trt_loader import import_trt
    from arborspec.runtime.errors import EngineError

    try:
        return import_trt(None if flavour in (None, "", "auto") else flavour, need="Builder")
    except EngineError as e:
        if str(e).startswith("unknown TensorRT flavour"):
            raise EngineBuildError(str(e)) from None
        raise TensorRTNotInstalled(str(e)) from None


def supported_compute_capabilities(trt) -> list[str]:
    """'X.Y' strings for the SMxy members of trt.ComputeCapability (tensorrt_rtx only)."""
    cc = getattr(trt, "ComputeCapability", None)
    if cc is None:
        return []
    out = []
    for name in cc.__members__:
        m = re.fullmatch(r"SM(\d+)(\d)", name)
        if m:
            out.append(f"{int(m.group(1))}.{m.group(2)}")
    return sorted(out, key=lambda s: tuple(int(x) for x in s.split(".")))


def normalize_compute_capability(value: str | float | tuple | None) -> str | None:
    """'8.9', '89', 'sm89', 'SM_89', 8.9, (8, 9) -> '8.9'; None stays None."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return f"{int(value[0])}.{int(value[1])}"
    s = str(value).strip().lower().replace("sm_", "").replace("sm", "").replace("compute_", "")
    m = re.fullmatch(r"(\d+)\.(\d)", s) or re.fullmatch(r"(\d+)(\d)", s)
    if not m:
        raise EngineBuildError(f"bad compute capability {value!r}: expected MAJOR.MINOR such as 8.9")
    return f"{int(m.group(1))}.{m.group(2)}"


def _cc_enum(trt, cc: str):
    major, minor = cc.split(".")
    supported = supported_compute_capabilities(trt)
    if cc not in supported:
        raise EngineBuildError(
            f"compute capability {cc} is not supported by {trt.__name__} "
            f"{trt.__version__}: supported are {', '.join(supported)}"
        )
    return getattr(trt.ComputeCapability, f"SM{major}{minor}")


def _local_gpu_cc() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return "%d.%d" % torch.cuda.get_device_capability()
    except Exception:  # noqa: BLE001
        pass
    return None


# --------------------------------------------------------------------------- logging


def _logger(trt):
    """The process-wide collecting TensorRT logger (shared with the runtime's engines)."""
    from arborspec.runtime.backends.trt_loader import trt_logger

    return trt_logger(trt)


def _progress_monitor(trt, echo: Callable[[str], None]):
    """An IProgressMonitor printing the top two levels of build phases (None if unsupported)."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class _Monitor(base):
        def __init__(self):
            base.__init__(self)
            self.depth: dict[str, int] = {}
            self.t0 = time.perf_counter()

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                d = 0 if parent_phase is None else self.depth.get(parent_phase, 0) + 1
                self.depth[phase_name] = d
                if d <= 1:
                    echo(f"  {'  ' * d}{phase_name} ({num_steps} steps) +{time.perf_counter() - self.t0:.1f}s")
            except Exception:  # noqa: BLE001 - never break a build over a message
                pass

        def step_complete(self, phase_name, step):
            return True  # keep building

        def phase_finish(self, phase_name):
            pass

    return _Monitor()


# --------------------------------------------------------------------------- profiles


@dataclass
class Profile:
    """Ranges (min, opt, max) per symbolic dimension; S is the mask's last dim (P + T)."""

    name: str
    B: tuple[int, int, int]
    T: tuple[int, int, int]
    P: tuple[int, int, int]
    N: tuple[int, int, int] = (1, 1, 1)  # rows of an EAGLE-3 projection graph (target_features [N, F])

    @property
    def S(self) -> tuple[int, int, int]:
        return tuple(t + p for t, p in zip(self.T, self.P))  # self-consistent at min/opt/max

    def covers(self, b: int, t: int, p: int) -> bool:
        return self.B[0] <= b <= self.B[2] and self.T[0] <= t <= self.T[2] and self.P[0] <= p <= self.P[2]


def plan_profiles(max_batch: int, max_tree_nodes: int, max_context: int) -> list[Profile]:
    """Decode/tree profile first (tuned for the verify call), then the prefill profile.

    prefill: T 1..max_context, P 0..max_context-1 (any call with P + T <= max_context);
    decode:  T 1..max_tree_nodes+1 (root + nodes), P 0..max_context-1, tuned at
             T = max_tree_nodes+1, P = max_context/2. Left out when it would not be smaller.
    Max shapes are self-consistent (mask S = P + T), as TensorRT checks."""
    for name, v, lo in (
        ("max_batch", max_batch, 1),
        ("max_tree_nodes", max_tree_nodes, 0),
        ("max_context", max_context, 2),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise EngineBuildError(f"{name} must be an integer >= {lo}, got {v!r}")
    if max_tree_nodes + 1 > max_context:
        raise EngineBuildError(
            f"no profile can hold max_tree_nodes={max_tree_nodes}: a verify call "
            f"of {max_tree_nodes + 1} tokens (root + nodes) exceeds "
            f"max_context={max_context}"
        )
    b = (1, max_batch, max_batch)
    c = max_context
    t_opt = min(c, max(1, c // 2))
    prefill = Profile("prefill", b, (1, t_opt, c), (0, 0, c - 1))
    n = max_tree_nodes + 1
    profiles = []
    if n < c:
        profiles.append(Profile("decode", b, (1, n, n), (0, min(c // 2, c - 1), c - 1)))
    profiles.append(prefill)
    return profiles


def plan_projection_profiles(max_batch: int, max_tree_nodes: int, max_context: int) -> list[Profile]:
    """The one profile of an EAGLE-3 projection graph (`draft_fc.onnx`, target_features [N, F]):
    N = 1..max_batch * max_context rows (a draft's first call projects a whole prompt's features,
    later ones an accepted path's), tuned at one tree's worth."""
    plan_profiles(max_batch, max_tree_nodes, max_context)  # the same limit checks
    n = max_batch * max_context
    one = (1, 1, 1)
    return [Profile("projection", one, one, (0, 0, 0), (1, min(n, max_tree_nodes + 1), n))]


def _dim_roles(name: str) -> tuple[str, ...] | None:
    if name in (IDS, POS, C.HIDDEN_IN):
        return ("B", "T")
    if name == C.TARGET_FEATURES:
        return ("N",)
    if name == MASK:
        return ("B", "T", "S")
    if _PAST_RE.match(name):
        return ("P", "B")  # then static Hkv, D
    return None


def _shapes_for(profile: Profile, name: str, net_shape: tuple[int, ...]) -> dict[str, tuple]:
    """min/opt/max shapes for one network input under a profile; checks static dims."""
    roles = _dim_roles(name)
    if roles is None:
        raise EngineBuildError(
            f"input {name!r} is not part of the engine contract ({IDS}, {POS}, {MASK}, past_key.i, "
            f"past_value.i; {C.HIDDEN_IN} or {C.TARGET_FEATURES} for an EAGLE-3 head)"
        )
    if len(net_shape) < len(roles):
        raise EngineBuildError(
            f"input {name!r} has rank {len(net_shape)}, the contract needs >= {len(roles)} ({', '.join(roles)}, ...)"
        )
    out = {}
    for k, which in enumerate(("min", "opt", "max")):
        shape = []
        for d, size in enumerate(net_shape):
            if d < len(roles):
                rng = getattr(profile, roles[d])
                want = rng[k]
                if size >= 0 and not (rng[0] == rng[2] == size):
                    raise EngineBuildError(
                        f"no profile can hold the limits: ONNX input {name!r} fixes dimension "
                        f"{d} ({roles[d]}) to {size}, but the {profile.name} profile needs "
                        f"{roles[d]} in [{rng[0]}, {rng[2]}]; re-export with that axis dynamic "
                        f"(example sizes >= 2) or change the limits"
                    )
                shape.append(want)
            else:
                if size < 0:
                    raise EngineBuildError(
                        f"input {name!r} has a dynamic dimension {d} that "
                        f"the contract fixes (heads / head dim); re-export "
                        f"with static head sizes"
                    )
                shape.append(size)
        out[which] = tuple(shape)
    return out


# --------------------------------------------------------------------------- helpers


def _onnx_metadata(path: Path) -> dict[str, str]:
    """metadata_props of the ONNX (contract version, model config, tokenizer), if onnx is
    installed; {} otherwise."""
    try:
        import onnx

        m = onnx.load(str(path), load_external_data=False)
        return {p.key: p.value for p in m.metadata_props}
    except Exception:  # noqa: BLE001 - metadata is informative only
        return {}


def _dtype_name(trt, dt) -> str:
    names = {
        "FLOAT": "float32",
        "HALF": "float16",
        "BF16": "bfloat16",
        "INT8": "int8",
        "INT32": "int32",
        "INT64": "int64",
        "BOOL": "bool",
        "UINT8": "uint8",
        "FP8": "float8",
    }
    n = str(dt).split(".")[-1]
    return names.get(n, n.lower())


def _cuda_noise(msg: str) -> bool:
    """TensorRT-RTX logs a CUDA driver error on machines without a GPU even when an ahead-of-time
    build succeeds: not a reason worth reporting."""
    return "cudaError 35" in msg or "CUDA driver version is insufficient" in msg


def _parse(trt, builder, logger, onnx_path: Path):
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    logger.take()
    from .trt_weights import mapped_weights

    mapped = mapped_weights(onnx_path, parser)  # external data: by address, pages given back while building
    ok = mapped.load_into(parser) if mapped is not None else parser.parse_from_file(str(onnx_path))
    if not ok or parser.num_errors:
        errs, ops = [], []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            try:
                op, node_name, desc = e.node_operator(), e.node_name(), e.desc()
            except Exception:  # noqa: BLE001 - older bindings
                op, node_name, desc = "", "", str(e)
            if op:
                ops.append(op)
            where = f"node {node_name!r} ({op}): " if op else ""
            errs.append(f"{where}{desc}".strip())
        details = []
        for e in errs + [e for e in logger.take() if not _cuda_noise(e)]:
            for line in e.splitlines():
                if line.strip() and line.strip() not in details:
                    details.append(line.strip())
        details = details or ["the parser gave no reason"]
        head = f"{onnx_path.name}: {trt.__name__} {trt.__version__} cannot parse this ONNX model"
        if ops:
            head += f" (unsupported or rejected ops: {', '.join(sorted(set(ops)))})"
        first = list(dict.fromkeys(errs)) or details
        raise EngineBuildError(head + ": " + "; ".join(first[:6]) + "\n" + "\n".join(details))
    if network.num_layers == 0 and network.num_inputs == 0 and network.num_outputs == 0:
        # protobuf decodes many non-ONNX files as an empty model without complaint
        raise EngineBuildError(
            f"{onnx_path.name} is not an ONNX model (it decodes to an empty "
            f"graph): pass the target.onnx/draft.onnx of an export folder"
        )
    return network, parser, mapped


def network_io(trt, network) -> dict[str, list[dict[str, Any]]]:
    """Names, dtypes and (symbolic -1) shapes of a parsed network's inputs and outputs."""

    def desc(t):
        return {"name": t.name, "dtype": _dtype_name(trt, t.dtype), "shape": list(t.shape)}

    return {
        "inputs": [desc(network.get_input(i)) for i in range(network.num_inputs)],
        "outputs": [desc(network.get_output(i)) for i in range(network.num_outputs)],
    }


def is_projection(io: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether a parsed network is an EAGLE-3 projection graph (target_features -> hidden_states)."""
    return [d["name"] for d in io["inputs"]] == [C.TARGET_FEATURES]


def check_contract(io: dict[str, list[dict[str, Any]]]) -> None:
    """Raise EngineBuildError if the network's I/O does not follow the engine contract (or, for
    an EAGLE-3 projection graph, its own: target_features [N, F] -> hidden_states [N, H])."""
    ins = {d["name"]: d for d in io["inputs"]}
    outs = {d["name"]: d for d in io["outputs"]}
    if is_projection(io):
        if list(outs) != [C.HIDDEN_STATES]:
            raise EngineBuildError(f"an EAGLE-3 projection graph must output {C.HIDDEN_STATES} only, not {list(outs)}")
        return
    missing = [n for n in (IDS, POS, MASK) if n not in ins]
    if "logits" not in outs:
        missing.append("logits (output)")
    layers = sorted({int(m.group(2)) for n in ins if (m := _PAST_RE.match(n))})
    if layers != list(range(len(layers))):
        missing.append(f"past_key/past_value for layers 0..{max(layers)}")
    for i in layers:
        for kind in ("key", "value"):
            if f"past_{kind}.{i}" not in ins:
                missing.append(f"past_{kind}.{i}")
            if f"new_{kind}.{i}" not in outs:
                missing.append(f"new_{kind}.{i} (output)")
    if missing:
        raise EngineBuildError(f"the ONNX does not follow the engine contract: missing {', '.join(missing)}")
    want = {IDS: "int64", POS: "int64", MASK: "bool"}
    for n, dt in want.items():
        if ins[n]["dtype"] != dt:
            raise EngineBuildError(f"contract input {n!r} must be {dt}, the ONNX has {ins[n]['dtype']}")


# --------------------------------------------------------------------------- build


@dataclass
class BuildResult:
    engine_path: Path
    manifest_path: Path
    entry: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def build_engine(
    onnx_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    max_batch: int = 1,
    max_tree_nodes: int = 64,
    max_context: int = 2048,
    compute_capability: str | None = None,
    flavour: str = "auto",
    log: Callable[[str], None] | None = None,
    verbose: bool = False,
    workspace_bytes: int | None = None,
) -> BuildResult:
    """Build one engine from a contract ONNX and record it in `engines.json` beside it.

    onnx_path: a contract ONNX (`target.onnx`, `draft.onnx`; external data beside it is fine).
    out_path: where the serialized engine goes (e.g. `engines/target.engine`); the manifest
      entry is keyed by its stem.
    max_batch, max_tree_nodes, max_context: the limits the profiles must hold (B <= max_batch,
      a verify call of max_tree_nodes+1 tokens, P + T <= max_context).
    compute_capability: 'X.Y' to build ahead of time (tensorrt_rtx; works without a GPU);
      None builds for the local GPU. Standard TensorRT can only build for the GPU it runs on.
    flavour: auto | tensorrt | tensorrt_rtx (env ARBORSPEC_TRT_MODULE overrides auto).
    log: stage messages (e.g. `lambda s: print(s, file=sys.stderr)`); None is quiet.
    Raises FileNotFoundError, TensorRTNotInstalled, EngineBuildError."""
    t_start = time.perf_counter()
    say = log or (lambda s: None)
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    meta, cc = _check_request(onnx_path, max_batch, max_tree_nodes, max_context, compute_capability)
    trt, flav = import_tensorrt(flavour)
    is_rtx = flav == "tensorrt_rtx"
    logger = _logger(trt)
    logger.echo, logger.verbose = (log if verbose else None), verbose
    cc_enum, target_cc = _resolve_compute_capability(trt, flav, cc)
    say(f"{onnx_path.name}: parsing with {flav} {trt.__version__}")
    builder = trt.Builder(logger)
    network, parser, mapped = _parse(trt, builder, logger, onnx_path)
    io = network_io(trt, network)
    profiles = _contract_profiles(io, max_batch, max_tree_nodes, max_context)
    config = _builder_config(trt, builder, workspace_bytes, cc_enum)
    prof_desc = _add_profiles(builder, config, logger, io, profiles)
    cache_path = out_path.with_name(out_path.name + (".runtime.cache" if is_rtx else ".timing.cache"))
    timing_cache = _use_timing_cache(config, cache_path, is_rtx)

    if log and (monitor := _progress_monitor(trt, say)) is not None:
        config.progress_monitor = monitor
    say(
        f"{onnx_path.name}: building for compute capability {target_cc or 'local'} "
        f"({', '.join(p['name'] for p in prof_desc)} profiles; B<={max_batch}, "
        f"tree<={max_tree_nodes}, context<={max_context})"
    )
    with mapped.releasing() if mapped is not None else contextlib.nullcontext():
        build_s = _build_to_file(trt, builder, network, config, logger, onnx_path.name, out_path)
    del network, parser  # they hold the mapped weights' addresses: gone before the unmapping
    if mapped is not None:
        mapped.close()
    if timing_cache is not None:
        atomic_write_bytes(cache_path, bytes(memoryview(timing_cache.serialize())))
    entry = {
        "file": out_path.name,
        "bytes": out_path.stat().st_size,
        "onnx": str(onnx_path.resolve()),
        "onnx_sha256": sha256_file(onnx_path),
        "onnx_metadata": _onnx_metadata(onnx_path),
        "limits": {"max_batch": max_batch, "max_tree_nodes": max_tree_nodes, "max_context": max_context},
        "profiles": prof_desc,
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "n_layers": sum(1 for d in io["inputs"] if d["name"].startswith("past_key.")),
        "role": meta.get(C.META_ROLE, ""),
        "trt": {"module": flav, "version": trt.__version__},
        "compute_capability": target_cc,
        "cache": {"kind": "runtime" if is_rtx else "timing", "file": cache_path.name},
        "build_seconds": round(build_s, 3),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    manifest_path = update_manifest(out_path.parent, out_path.stem, entry)
    total = time.perf_counter() - t_start
    say(f"{onnx_path.name}: wrote {out_path} ({entry['bytes'] / 2**20:.1f} MiB) in {total:.1f}s")
    return BuildResult(out_path, manifest_path, entry, total)


def _check_request(onnx_path: Path, max_batch: int, max_tree_nodes: int, max_context: int, compute_capability):
    """Refuse a missing file, a "bhsd" graph or bad limits before TensorRT is imported;
    returns the ONNX metadata and the normalized compute capability ('X.Y' or None)."""
    if not onnx_path.is_file():
        raise MissingFileError(f"ONNX file not found: {onnx_path}")
    from .preflight import check_build

    check_build([onnx_path], str(onnx_path.parent))  # memory: one line before TensorRT is imported
    meta = _onnx_metadata(onnx_path)
    if meta.get(C.META_KV_LAYOUT) == "bhsd":
        raise EngineBuildError(gqa_graph_message(onnx_path.name, meta))
    plan_profiles(max_batch, max_tree_nodes, max_context)  # bad limits: one line before any parsing
    return meta, normalize_compute_capability(compute_capability)


def _contract_profiles(io: dict, max_batch: int, max_tree_nodes: int, max_context: int):
    """The parsed network's profiles: a contract forward's, or a projection graph's (checked first)."""
    check_contract(io)
    if is_projection(io):
        return plan_projection_profiles(max_batch, max_tree_nodes, max_context)
    return plan_profiles(max_batch, max_tree_nodes, max_context)


def _build_to_file(trt, builder, network, config, logger, name: str, out_path: Path) -> float:
    """Build the engine into `out_path` (atomically); returns the build's seconds. Where the
    builder can write to a stream (TensorRT >= 10.7, TensorRT-RTX) the engine goes to the file as
    it is serialized: the process never holds the whole serialized engine beside the builder's
    own copy of the weights (one engine's size less at the peak)."""
    from arborspec.runtime.fileio import atomic_write

    stream = getattr(builder, "build_serialized_network_to_stream", None)
    if stream is None or not hasattr(trt, "IStreamWriter"):
        serialized, build_s = _build_serialized(builder, network, config, logger, name)
        atomic_write_bytes(out_path, memoryview(serialized))
        return build_s

    class _FileWriter(trt.IStreamWriter):
        def __init__(self, f):
            trt.IStreamWriter.__init__(self)
            self.f, self.n = f, 0

        def write(self, data) -> int:
            self.n += self.f.write(data)
            return len(data)

    seconds = []

    def build(f):
        logger.take()
        t0 = time.perf_counter()
        writer = _FileWriter(f)
        ok = stream(network, config, writer)
        seconds.append(time.perf_counter() - t0)
        _raise_on_failure(ok and writer.n > 0, logger, name)

    atomic_write(out_path, build, "wb")
    return seconds[0]


def _raise_on_failure(ok: bool, logger, name: str) -> None:
    """EngineBuildError with TensorRT's own errors when a build gave nothing."""
    errors = [e for e in logger.take() if not _cuda_noise(e)]
    if not ok:
        raise EngineBuildError(
            f"{name}: TensorRT build failed: "
            + ("; ".join(e.splitlines()[0] for e in errors[:4]) or "no reason given")
            + ("\n" + "\n".join(errors) if errors else "")
        )


def _resolve_compute_capability(trt, flav: str, cc: str | None):
    """The GPU the engine is built for: (TensorRT-RTX's compute-capability enum or None for a
    local build, its 'X.Y' or None). Standard TensorRT builds only for the local GPU."""
    local_cc = _local_gpu_cc()
    if flav == "tensorrt_rtx":
        if cc is None and local_cc is None:
            raise EngineBuildError(
                "no CUDA GPU here: name the target GPU's compute capability "
                "(e.g. --compute-capability 8.9); supported: " + ", ".join(supported_compute_capabilities(trt))
            )
        # no name: the local GPU's, which must be one TensorRT-RTX supports (no Hopper SM 9.0)
        cc = cc or local_cc
        cc_enum = _cc_enum(trt, cc)
    else:
        if local_cc is None:
            raise EngineBuildError(
                f"{flav} {trt.__version__} builds only for the GPU it runs on "
                f"and no CUDA GPU is visible; build ahead of time with "
                f"tensorrt_rtx ({ENV_MODULE}=tensorrt_rtx, --compute-capability)"
            )
        if cc is not None and cc != local_cc:
            raise EngineBuildError(
                f"{flav} builds for the local GPU (compute capability "
                f"{local_cc}), not {cc}; use tensorrt_rtx for ahead-of-time "
                f"builds"
            )
        cc_enum = None
    return cc_enum, cc or local_cc


def _builder_config(trt, builder, workspace_bytes: int | None, cc_enum):
    """The builder config: the workspace limit and, ahead of time, the one target GPU."""
    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    if cc_enum is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(cc_enum, 0)
    return config


def _add_profiles(builder, config, logger, io: dict, profiles) -> list[dict]:
    """Add one optimization profile per planned range; returns their manifest descriptions."""
    prof_desc = []
    for prof in profiles:
        op = builder.create_optimization_profile()
        shapes = {}
        for d in io["inputs"]:
            s = _shapes_for(prof, d["name"], tuple(d["shape"]))
            op.set_shape(d["name"], s["min"], s["opt"], s["max"])
            shapes[d["name"]] = {k: list(v) for k, v in s.items()}
        idx = config.add_optimization_profile(op)
        if idx < 0:
            raise EngineBuildError(f"TensorRT rejected the {prof.name} profile: " + "; ".join(logger.take()[:3]))
        prof_desc.append(
            {
                "index": idx,
                "name": prof.name,
                "ranges": (
                    {"N": list(prof.N)}
                    if prof.name == "projection"
                    else {"B": list(prof.B), "T": list(prof.T), "P": list(prof.P), "S": list(prof.S)}
                ),
                "shapes": shapes,
            }
        )
    return prof_desc


def _use_timing_cache(config, cache_path: Path, is_rtx: bool):
    """Standard TensorRT: seed the config's timing cache from `cache_path` (if any); the cache
    object to save after the build, or None (TensorRT-RTX keeps a runtime cache instead)."""
    timing_cache = None
    if not is_rtx and hasattr(config, "create_timing_cache"):
        blob = cache_path.read_bytes() if cache_path.is_file() else b""
        timing_cache = config.create_timing_cache(blob)
        config.set_timing_cache(timing_cache, True)
    return timing_cache


def _build_serialized(builder, network, config, logger, name: str):
    """Build the serialized engine: (host memory, seconds); EngineBuildError with TensorRT's
    own errors when it returns nothing."""
    logger.take()
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    _raise_on_failure(serialized is not None and serialized.nbytes > 0, logger, name)
    return serialized, build_s


def gqa_graph_message(name: str, meta: dict[str, str]) -> str:
    """The one line for a "bhsd" graph (ONNX Runtime's GroupQueryAttention, a contrib op)."""
    if meta.get(C.META_ROLE) == C.ROLE_EAGLE3:
        return (
            f"{name} is the EAGLE-3 head's GroupQueryAttention graph (ONNX Runtime only; TensorRT cannot "
            "parse it): re-export with --attention onnx (`arborspec export ... --draft eagle3 --attention onnx`)"
        )
    return (
        f"{name} is ONNX Runtime's fast graph (GroupQueryAttention, a contrib op TensorRT cannot "
        "parse): re-export with --attention onnx to build TensorRT engines"
    )


def update_manifest(folder: str | os.PathLike, key: str, entry: dict[str, Any]) -> Path:
    """Merge one engine's entry into `<folder>/engines.json` (atomic rewrite)."""
    man = C.read_engines_manifest(folder, missing_ok=True) or C.EnginesManifest(Path(folder))
    man.data["format"] = MANIFEST_FORMAT
    man.engines[key] = entry
    return atomic_write_json(Path(folder) / MANIFEST_NAME, man.data, sort_keys=True)


def read_manifest(folder_or_engine: str | os.PathLike) -> dict[str, Any]:
    """The engines.json of a folder (or of the folder holding an engine file), as a dict."""
    return C.read_engines_manifest(folder_or_engine).data


engine_entry = C.engine_entry  # the engines.json entry of one engine file, or None


def _main(argv=None) -> int:  # python -m arborspec.export.trt_build ONNX ENGINE [CC]
    a = list(sys.argv[1:] if argv is None else argv)
    r = build_engine(
        a[0], a[1], compute_capability=a[2] if len(a) > 2 else None, log=lambda s: print(s, file=sys.stderr)
    )
    print(json.dumps(r.entry["profiles"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
