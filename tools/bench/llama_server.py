"""llama.cpp's own server (`llama-server`) as a bench peer, with its own speculative modes.

Role in one decode step: none; this is what a CPU user who wants speculation runs instead of
arborspec. `arborspec bench --baselines llama-server,llama-server-ngram-mod,...` runs it on the
same GGUF and the same prompt token ids as ours.

- Binaries: `llama_cpp_tools()` finds llama.cpp's llama-server / llama-quantize / llama-bench and
  its converter (convert_hf_to_gguf.py) in `$ARBORSPEC_LLAMA_CPP` (a llama.cpp source tree built
  with cmake into build/bin) or in the cache (`<cache>/llama.cpp/<version>/`, the llama.cpp that
  llama-cpp-python's sdist vendors, built there once: static binaries). The build is GGML_NATIVE
  unless the CPU advertises AMX that does not run (tools/bench/llama_build_flags.py): then
  GGML_NATIVE off with the instruction sets the CPU runs named one by one and AMX off, in
  `<cache>/llama.cpp/<version>-noamx/`, so weight repacking (its AVX-512 layouts) stays usable.
- One server per configuration (SERVER_SPECS), on a free loopback port, health-checked, stopped
  after the bench (`close`). Each request: POST /completion with the prompt as token ids,
  n_predict = max new tokens, greedy (temperature 0, top_k 1), cache_prompt false (every prompt
  prefilled in full), return_tokens. Timings are the server's own: tokens/s = its
  predicted_per_second ((tokens - 1) / time after the first token, as ours), prefill = its
  prompt_ms (until the first token); target calls = tokens - draft_n_accepted (each call emits
  one token of its own besides the accepted drafts; the prompt's call is one).
- draft-eagle3: the export's own EAGLE-3 head, converted by llama.cpp's converter
  (`convert_hf_to_gguf.py HEAD --target-model-dir TARGET --outtype q8_0`, TARGET: a folder with
  the target's config.json and tokenizer that transformers writes from the GGUF), cached.
- AMX: where the CPU advertises AMX (amx_tile / amx_int8 / amx_bf16 in /proc/cpuinfo), ggml's AMX
  kernels (reached through weight repacking) die with SIGILL on VMs that do not grant it; the
  `noamx` build (above) has none. As a last guard the first server runs a short batched prompt as
  a probe; a SIGILL restarts it with --no-repack, for every configuration after it, and the bench
  says so.
- Repacking on and off: `NAME-repack-on` / `NAME-repack-off` (e.g. llama-server-ngram-mod-repack-off)
  run a configuration with weight repacking forced on / off; which is faster depends on the weight
  type and the hour, so a sitting runs both and reports both (benchmarks/vs_llamacpp.py keeps the
  faster per configuration). A bare NAME takes the probe's choice.
A server that dies or does not answer in time is one line (PeerUnavailable), never a hang.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from arborspec.runtime import settings
from arborspec.tools.bench.llama_build_flags import (
    AMX_FLAGS,
    amx_instructions_run,
    build_flavour,
    flavour_cmake_flags,
    flavour_folder,
)
from arborspec.tools.bench.peer_base import PeerUnavailable, _cut_at_eos, _one_line, _run_dict, pkg_version

LLAMA_PKG = "llama-cpp-python"
DEFAULT_LLAMA_VERSION = "0.3.36"  # the sdist fetched when llama-cpp-python is not installed
TARGETS = ("llama-server", "llama-quantize", "llama-bench")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # static binaries: the build folder can be renamed into the cache
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
)
REPACK_SUFFIXES = {"-repack-on": False, "-repack-off": True}  # name suffix -> --no-repack


# ---------------------------------------------------------------------------------- binaries
@dataclass(frozen=True)
class LlamaCppTools:
    """Paths of one llama.cpp build: its binaries, its converter and the source tree."""

    root: Path  # the llama.cpp source tree (gguf-py/ under it)
    version: str  # the llama-cpp-python version that vendors it ("local" for $ARBORSPEC_LLAMA_CPP)
    server: Path
    quantize: Path
    bench: Path
    converter: Path  # convert_hf_to_gguf.py
    flavour: str = "native"  # native | noamx (llama_build_flags); "local" for $ARBORSPEC_LLAMA_CPP

    @classmethod
    def at(cls, root: Path, version: str, flavour: str = "native") -> "LlamaCppTools":
        b = root / "build" / "bin"
        return cls(
            root,
            version,
            b / "llama-server",
            b / "llama-quantize",
            b / "llama-bench",
            root / "convert_hf_to_gguf.py",
            flavour,
        )

    def complete(self) -> bool:
        return all(p.is_file() for p in (self.server, self.quantize, self.bench, self.converter))


def llama_cpp_root() -> Path:
    from arborspec.models.registry import cache_dir

    return cache_dir() / "llama.cpp"


def llama_cpp_tools(build: bool = True, log=None, flags: set[str] | None = None, amx_runs=None) -> LlamaCppTools:
    """llama.cpp's tools: `.server` (llama-server), `.quantize` (llama-quantize), `.bench`
    (llama-bench), `.converter` (convert_hf_to_gguf.py; run it with this Python: it imports its own
    gguf-py from `.root`), `.root` (the source tree), `.version`.

    Looked up in order: `$ARBORSPEC_LLAMA_CPP` (a llama.cpp tree with build/bin/ already built),
    then `<cache>/llama.cpp/<version>/` (cache: $ARBORSPEC_CACHE, else ~/.cache/arborspec; version:
    the installed llama-cpp-python's, else 0.3.36; `<version>-noamx/` where the CPU advertises AMX
    that does not run: flags (default /proc/cpuinfo's) and amx_runs() (default: AMX instructions
    tried, llama_build_flags.amx_instructions_run) decide). With build=True a missing build is made there
    once from llama-cpp-python's sdist (pip download; about 20-30 minutes on 2 cores; cmake and a
    C++ compiler needed). Raises PeerUnavailable with a one-line reason otherwise."""
    log = log or (lambda s: print(s, file=sys.stderr))
    env = settings.raw("ARBORSPEC_LLAMA_CPP")
    if env:
        tools = LlamaCppTools.at(Path(env).expanduser(), "local", "local")
        if not tools.complete():
            raise PeerUnavailable(
                f"$ARBORSPEC_LLAMA_CPP={env}: no build/bin/{{{','.join(TARGETS)}}} and convert_hf_to_gguf.py there"
            )
        return tools
    version = pkg_version(LLAMA_PKG) or DEFAULT_LLAMA_VERSION
    flags = cpu_flags() if flags is None else flags
    flavour = build_flavour(flags, amx_runs or amx_instructions_run)
    tools = LlamaCppTools.at(llama_cpp_root() / flavour_folder(version, flavour), version, flavour)
    if tools.complete():
        return tools
    if not build:
        raise PeerUnavailable(
            f"llama.cpp {version} ({flavour} build) is not built in {tools.root} (build it: llama_cpp_tools(build=True))"
        )
    _build_into_cache(version, tools.root, log, flavour_cmake_flags(flavour, flags))
    return LlamaCppTools.at(tools.root, version, flavour)


def _missing_build_tools() -> str | None:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None and not (tool == "c++" and shutil.which("g++")):
            return f"{tool} is not installed (apt-get install cmake g++)"
    return None


def _sdist(version: str, work: Path) -> Path:
    """llama-cpp-python's sdist (.tar.gz), downloaded with pip into `work`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_PKG, "-d", str(work)]
    r = subprocess.run(cmd + [f"{LLAMA_PKG}=={version}"], capture_output=True, text=True)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode != 0 or not found:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise PeerUnavailable(
            f"cannot download the {LLAMA_PKG} {version} sdist ({lines[-1] if lines else 'no output'})"
        )
    return found[0]


def _build_into_cache(version: str, root: Path, log, isa_flags: list[str]) -> None:
    """Extracts vendor/llama.cpp from the sdist, builds TARGETS with cmake (CMAKE_FLAGS + isa_flags:
    llama_build_flags.flavour_cmake_flags), renames into `root`."""
    from arborspec.runtime.fileio import PartialFolder

    why = _missing_build_tools()
    if why:
        raise PeerUnavailable(f"cannot build llama.cpp: {why}")
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root.parent, prefix=".sdist-"))
    try:
        sdist = _sdist(version, work)
        with PartialFolder(root, keep_existing=True) as tree:
            with tarfile.open(sdist) as tf:
                tf.extractall(work, filter="data")
            vendored = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
            if vendored is None:
                raise PeerUnavailable(f"{sdist.name} has no vendor/llama.cpp")
            shutil.rmtree(tree, ignore_errors=True)
            shutil.move(str(vendored), str(tree))
            log(f"building llama.cpp {version} ({', '.join(TARGETS)}; {' '.join(isa_flags)}; once, into {root}) ...")
            for cmd in (
                ["cmake", "-S", str(tree), "-B", str(tree / "build"), *CMAKE_FLAGS, *isa_flags],
                ["cmake", "--build", str(tree / "build"), "-j", str(os.cpu_count() or 1), "--target", *TARGETS],
            ):
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
                    raise PeerUnavailable(f"llama.cpp's build failed ({lines[-1] if lines else cmd[1]})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------- AMX
def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@dataclass
class RepackChoice:
    """Whether llama-server gets --no-repack, and why (printed once by the bench)."""

    no_repack: bool
    reason: str


def choose_repack(flags: set[str], probe) -> RepackChoice:
    """`probe(no_repack)`: runs a short batched prompt on a server started with or without
    --no-repack -> None if it ran, else the server's exit status (negative: the signal). Where the
    CPU advertises AMX and the server dies by a signal (SIGILL, or SIGSEGV: both seen on the same
    Xeon VM) but runs with --no-repack -> --no-repack."""
    amx = sorted(set(AMX_FLAGS) & flags)
    if not amx:
        return RepackChoice(False, "the CPU advertises no AMX: weight repacking on")
    status = probe(False)
    if status is None:
        return RepackChoice(False, f"the CPU advertises AMX ({', '.join(amx)}) and its kernels run: repacking on")
    if status >= 0:
        raise PeerUnavailable(f"llama-server died on a short prompt ({_exit_text(status)})")
    again = probe(True)
    if again is not None:
        raise PeerUnavailable(f"llama-server died on a short prompt, also with --no-repack ({_exit_text(again)})")
    return RepackChoice(
        True,
        f"the CPU advertises AMX ({', '.join(amx)}) but llama.cpp's AMX kernels die here ({_exit_text(status)}; "
        "AMX not granted to this machine): llama-server runs with --no-repack",
    )


def _exit_text(status: int) -> str:
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit {status}"


# ---------------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class ServerSpec:
    """One llama-server configuration of the bench: its speculative type and draft length."""

    name: str
    spec_type: str | None = None  # --spec-type; None: no speculation
    draft_n_max: int | None = None  # --spec-draft-n-max (None: llama.cpp's default, 3)
    needs_head: bool = False  # -md: the export's EAGLE-3 head, converted

    def args(self, head_gguf: Path | None = None) -> list[str]:
        a = ["--spec-type", self.spec_type] if self.spec_type else []
        if self.needs_head:
            if head_gguf is None:
                raise PeerUnavailable(f"{self.name} needs an EAGLE-3 head (the export's draft is not one)")
            a += ["-md", str(head_gguf)]
        if self.draft_n_max is not None:
            a += ["--spec-draft-n-max", str(self.draft_n_max)]
        return a


def split_repack(name: str) -> tuple[str, bool | None]:
    """A peer name -> (its configuration in SERVER_SPECS, --no-repack forced: True / False, or None
    for the probe's choice). 'llama-server-ngram-mod-repack-off' -> ('llama-server-ngram-mod', True)."""
    for suffix, no_repack in REPACK_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], no_repack
    return name, None


SERVER_SPECS = {
    s.name: s
    for s in (
        ServerSpec("llama-server"),
        ServerSpec("llama-server-ngram-mod", "ngram-mod"),  # its defaults are those of --spec-default
        ServerSpec("llama-server-ngram-simple", "ngram-simple"),
        ServerSpec("llama-server-ngram-map-k", "ngram-map-k"),
        ServerSpec("llama-server-eagle3", "draft-eagle3", needs_head=True),
        ServerSpec("llama-server-eagle3-n2", "draft-eagle3", 2, needs_head=True),
    )
}


def server_command(
    tools: LlamaCppTools,
    spec: ServerSpec,
    gguf: Path,
    port: int,
    threads: int,
    n_ctx: int,
    no_repack: bool,
    head_gguf: Path | None = None,
) -> list[str]:
    """The llama-server command line of one configuration (one slot, loopback only)."""
    cmd = [str(tools.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1", "--no-webui"]
    cmd += spec.args(head_gguf)
    return cmd + (["--no-repack"] if no_repack else [])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():  # preexec_fn: the server goes when the bench process goes (Linux)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------- one server
@dataclass
class LlamaServer:
    """One llama-server process: start (health-checked), POST /completion, stop."""

    cmd: list[str]
    port: int
    start_timeout_s: float = 120.0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    load_s: float = 0.0
    _log: object = field(default=None, repr=False)

    def start(self) -> "LlamaServer":
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        atexit.register(self.stop)  # never left running by a bench that ends another way
        while time.perf_counter() - t0 < self.start_timeout_s:
            if self.proc.poll() is not None:
                raise PeerUnavailable(
                    f"llama-server exited while loading ({_exit_text(self.proc.returncode)}: {self.last_log_line()})"
                )
            try:
                if self._get("/health", 2.0).get("status") == "ok":
                    self.load_s = time.perf_counter() - t0
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        self.stop()
        raise PeerUnavailable(f"llama-server did not answer /health within {self.start_timeout_s:.0f} s")

    def _get(self, path: str, timeout: float) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float) -> dict:
        """One request; a server that died or does not answer within `timeout` -> PeerUnavailable."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise PeerUnavailable(
                f"llama-server answered {e.code} ({e.read()[:200].decode(errors='replace')})"
            ) from None
        except (OSError, ValueError) as e:
            status = self.wait_exit(2.0)
            if status is not None:
                raise PeerUnavailable(f"llama-server died ({_exit_text(status)}: {self.last_log_line()})") from None
            raise PeerUnavailable(f"llama-server did not answer within {timeout:.0f} s ({_one_line(e)})") from None

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def last_log_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except (OSError, AttributeError):
            return "no log"
        return lines[-1][:200] if lines else "no output"

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            if self.wait_exit(10.0) is None:
                self.proc.kill()
                self.wait_exit(10.0)
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None


# ---------------------------------------------------------------------------------- requests
def llama_sampler(
    temperature: float, seed: int, top_k=0, top_p=1.0, json_schema: dict | None = None, gbnf: str | None = None
) -> dict:
    """llama.cpp's sampler for a bench run, in /completion's field names (both llama.cpp peers take
    it: completion_body here, peers.LlamaCppRunner through the Python binding): greedy unless
    temperature > 0, then bench's top-k / top-p cut (0 / 1.0: none) and its seed; no min-p,
    typical-p or repetition penalty, as ours; json_schema (llama.cpp's own structured output: its
    GBNF grammar of the schema), else gbnf as the `grammar` it reads as it is."""
    s = {"repeat_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0}
    if temperature > 0:
        s.update(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed))
    else:
        s.update(temperature=0.0, top_k=1, top_p=1.0)
    if json_schema is not None:
        s["json_schema"] = json_schema
    elif gbnf is not None:
        s["grammar"] = gbnf
    return s


def completion_body(prompt: list[int], n: int, eos: list[int], temperature: float, seed: int, **cut) -> dict:
    """/completion's request: the prompt as token ids, llama_sampler's sampling (cut: its top_k,
    top_p, json_schema, gbnf), no prefix reuse between prompts."""
    return {
        "prompt": [int(t) for t in prompt],
        "n_predict": int(n),
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
        "ignore_eos": not eos,  # no eos ids: exactly n tokens, as ours
        **llama_sampler(temperature, seed, **cut),
    }


def run_from_response(resp: dict, n: int, eos: list[int]) -> dict:
    """A bench run (peers._run_dict) from /completion's answer and its `timings`."""
    toks, stop = _cut_at_eos([int(t) for t in resp.get("tokens") or []][:n], list(eos))
    tm = resp.get("timings") or {}
    predicted = int(tm.get("predicted_n") or len(toks))
    accepted = int(tm.get("draft_n_accepted") or 0)
    calls = max(predicted - accepted, 1) if toks else 0
    prefill_s = float(tm.get("prompt_ms") or 0.0) / 1e3
    decode_s = float(tm.get("predicted_ms") or 0.0) / 1e3
    stats = {
        k: tm[k]
        for k in ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_second", "draft_n", "draft_n_accepted")
        if k in tm
    }
    r = _run_dict(toks, prefill_s, decode_s, calls, stats)
    if len(toks) > 1 and tm.get("predicted_per_second"):
        r["tokens_per_s"] = float(tm["predicted_per_second"])  # the server's own: (predicted_n - 1) / predicted_ms
    r["stop_reason"] = stop
    return r


class LlamaServerRunner:
    """A bench peer: one started llama-server configuration (tools/bench/peers.py's interface)."""

    def __init__(self, spec: ServerSpec, server: LlamaServer, describe: dict, request_timeout_s: float = 600.0):
        self.spec, self.server, self.info = spec, server, describe
        self.request_timeout_s = request_timeout_s
        self.load_s = server.load_s

    def describe(self, name: str) -> dict:
        return dict(self.info)

    def run(self, kind: str, prompt: list[int], n: int, eos: list[int], temperature: float, seed: int, **cut) -> dict:
        """cut: top_k, top_p, json_schema, gbnf (completion_body's)."""
        body = completion_body(prompt, n, eos, temperature, seed, **cut)
        return run_from_response(self.server.post("/completion", body, self.request_timeout_s), n, eos)

    def close(self) -> None:
        self.server.stop()


# ---------------------------------------------------------------------------------- the EAGLE-3 head
def _hash_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def target_hf_dir(source: dict, cache: Path) -> Path:
    """A folder with the target's config.json and tokenizer, for the converter's --target-model-dir:
    the source folder itself, or (GGUF) what transformers writes from the GGUF's metadata (no weights)."""
    from arborspec.tools.bench.baselines import hf_source_path

    mdir, gguf, why = hf_source_path(source)
    if mdir is None:
        raise PeerUnavailable(why)
    if not gguf:
        return mdir
    out = cache / "targets" / _hash_files([mdir / gguf])[:16]
    if (out / "config.json").is_file():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoConfig, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from arborspec.runtime.fileio import PartialFolder

        hf_logging.set_verbosity_error()
        with PartialFolder(out, keep_existing=True) as tmp:
            AutoTokenizer.from_pretrained(str(mdir), gguf_file=gguf, local_files_only=True).save_pretrained(str(tmp))
            AutoConfig.from_pretrained(str(mdir), gguf_file=gguf, local_files_only=True).save_pretrained(str(tmp))
    except ImportError:
        raise PeerUnavailable("llama.cpp's converter needs the target's tokenizer: pip install transformers") from None
    except Exception as e:  # noqa: BLE001 - transformers raises many types; one line is the contract
        raise PeerUnavailable(f"transformers cannot read the config and tokenizer of {gguf} ({_one_line(e)})") from None
    return out


def head_gguf(tools: LlamaCppTools, head_dir: Path, target_dir: Path, outtype: str = "q8_0", log=None) -> Path:
    """The EAGLE-3 head converted by llama.cpp's converter (cached by the head's files and outtype)."""
    log = log or (lambda s: print(s, file=sys.stderr))
    files = [head_dir / "config.json"] + sorted(head_dir.glob("*.safetensors"))
    if not files[0].is_file():
        raise PeerUnavailable(f"{head_dir}: no config.json (not an EAGLE-3 checkpoint folder)")
    key = _hash_files(files + [target_dir / "config.json"])[:16]
    out = llama_cpp_root() / "heads" / f"{head_dir.name}-{key}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    cmd = [
        sys.executable,
        str(tools.converter),
        str(head_dir),
        "--target-model-dir",
        str(target_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(tmp),
    ]
    log(f"converting the EAGLE-3 head {head_dir} with llama.cpp's converter (once; cached in {out.parent}) ...")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise PeerUnavailable(
            f"llama.cpp's converter failed on {head_dir} ({lines[-1] if lines else f'exit {r.returncode}'})"
        )
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------- opening
PROBE_PROMPT = [(i % 13) + 3 for i in range(48)]  # a batched prompt reaches the repacked kernels


def _start(tools, spec, gguf, threads, n_ctx, no_repack, head) -> LlamaServer:
    port = free_port()
    return LlamaServer(server_command(tools, spec, gguf, port, threads, n_ctx, no_repack, head), port).start()


def start_probed(tools, spec, gguf, threads, n_ctx, head, flags: set[str] | None = None):
    """The first server, with the AMX probe (choose_repack) -> (server, RepackChoice)."""
    alive: list[LlamaServer] = []

    def probe(no_repack: bool):
        port = free_port()
        s = LlamaServer(server_command(tools, spec, gguf, port, threads, n_ctx, no_repack, head), port)
        try:
            s.start().post("/completion", completion_body(PROBE_PROMPT, 2, [], 0.0, 0), 120.0)
        except PeerUnavailable:
            status = s.wait_exit(5.0)
            s.stop()
            if status is None:  # alive but failing: not a matter of repacking
                raise
            return status
        alive.append(s)
        return None

    choice = choose_repack(cpu_flags() if flags is None else flags, probe)
    server = alive[0] if alive else _start(tools, spec, gguf, threads, n_ctx, choice.no_repack, head)
    return server, choice


def _start_forced(tools, spec, gguf, threads, n_ctx, no_repack: bool, head, choice: RepackChoice) -> LlamaServer:
    """A server with repacking as asked; repacking asked where the probe saw it die: one line."""
    if choice.no_repack and not no_repack:
        raise PeerUnavailable(f"weight repacking dies here ({choice.reason})")
    return _start(tools, spec, gguf, threads, n_ctx, no_repack, head)


def open_servers(
    names: list[str],
    source: dict,
    *,
    head_dir: Path | None,
    n_ctx: int,
    threads: int,
    log=None,
    tools: LlamaCppTools | None = None,
) -> tuple[dict, dict, dict]:
    """Starts one llama-server per configuration name -> (runners, info, skipped {name: reason})."""
    from arborspec.tools.bench.baselines import hf_source_path

    log = log or (lambda s: print(s, file=sys.stderr))
    runners: dict = {}
    info: dict = {}
    try:
        tools = tools or llama_cpp_tools(build=True, log=log)
        mdir, gguf, why = hf_source_path(source)
        if mdir is None or not gguf:
            raise PeerUnavailable(why or f"llama-server needs a GGUF file; the model source is a folder ({mdir})")
    except PeerUnavailable as e:
        return {}, {}, {n: str(e) for n in names}
    skipped: dict[str, str] = {}
    head = None
    if any(SERVER_SPECS[split_repack(n)[0]].needs_head for n in names):
        try:
            if head_dir is None:
                raise PeerUnavailable("the export's draft is not an EAGLE-3 head")
            head = head_gguf(tools, head_dir, target_hf_dir(source, llama_cpp_root()), log=log)
        except PeerUnavailable as e:
            skipped.update({n: str(e) for n in names if SERVER_SPECS[split_repack(n)[0]].needs_head})
    choice = None
    for name in [n for n in names if n not in skipped]:
        base, forced = split_repack(name)
        spec = SERVER_SPECS[base]
        try:
            if choice is None:
                server, choice = start_probed(tools, spec, mdir / gguf, threads, n_ctx, head)
                log(f"arborspec bench: note: llama-server ({tools.flavour} build): {choice.reason}")
                if forced is not None and forced != choice.no_repack:
                    server.stop()
                    server = _start_forced(tools, spec, mdir / gguf, threads, n_ctx, forced, head, choice)
            else:
                no_repack = choice.no_repack if forced is None else forced
                server = _start_forced(tools, spec, mdir / gguf, threads, n_ctx, no_repack, head, choice)
        except PeerUnavailable as e:
            skipped[name] = str(e)
            continue
        no_repack = choice.no_repack if forced is None else forced
        d = {
            "llama.cpp": tools.version,
            "build": tools.flavour,
            "binary": str(tools.server),
            "command": server.cmd,
            "no_repack": no_repack,
            "repack": choice.reason if forced is None else f"forced {'off' if forced else 'on'} by the name ({name})",
            "spec_type": spec.spec_type,
            "load_s": round(server.load_s, 2),
            "request": "POST /completion: prompt as token ids, greedy (temperature 0, top_k 1), cache_prompt false",
        }
        if spec.needs_head:
            d["head"] = {"checkpoint": str(head_dir), "gguf": str(head), "converter": str(tools.converter)}
        runners[name] = LlamaServerRunner(spec, server, d)
        info[name] = d
    return runners, info, skipped
