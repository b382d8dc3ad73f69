"""Which llama.cpp build this machine gets: GGML_NATIVE, or (where the CPU advertises AMX that does
not run) one with the instruction sets the CPU runs named one by one and AMX off.

Role in one decode step: none; it decides how the bench peer llama.cpp is compiled
(tools/bench/llama_server.py builds it into the cache, one folder per flavour).

Why: GGML_NATIVE compiles ggml's AMX kernels in wherever /proc/cpuinfo says amx_tile/amx_int8,
and the Xeon VMs here advertise AMX without granting it: the kernels (reached through weight
repacking) die with SIGILL. Turning repacking off keeps the server alive but also drops the
AVX-512 repacked layouts that make it fast (1B shape: 17.9 tok/s repacked vs 16.2 without;
a native build run with --no-repack measured 8.4-10). So such a machine gets the `noamx` flavour.
Whether AMX runs is measured, not guessed: a few AMX instructions compiled at run time
(`amx_instructions_run`), after asking the kernel for the tile state as ggml does.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
# ggml's cmake option -> the /proc/cpuinfo flags it needs (all of them); ggml's GGML_AVX512 compiles
# with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
ISA_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni", "avx2")),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi", "avx512f")),
    ("GGML_AVX512_VNNI", ("avx512_vnni", "avx512f")),
    ("GGML_AVX512_BF16", ("avx512_bf16", "avx512f")),
)
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
FLAVOURS = ("native", "noamx")


def isa_cmake_flags(flags: set[str]) -> list[str]:
    """The cmake flags of a non-native build for a CPU with these /proc/cpuinfo flags: every ISA
    option ggml has, ON where the CPU has all it needs, OFF otherwise; AMX always OFF."""
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in ISA_OPTIONS]
    return out + [f"-D{opt}=OFF" for opt in AMX_OPTIONS]


def build_flavour(flags: set[str], amx_runs) -> str:
    """'native' unless the CPU advertises AMX and `amx_runs()` says it does not run: 'noamx'.
    amx_runs is called only where AMX is advertised."""
    if set(AMX_FLAGS) & flags and not amx_runs():
        return "noamx"
    return "native"


def flavour_cmake_flags(flavour: str, flags: set[str]) -> list[str]:
    if flavour == "native":
        return ["-DGGML_NATIVE=ON"]
    if flavour == "noamx":
        return isa_cmake_flags(flags)
    raise ValueError(f"unknown llama.cpp build flavour {flavour!r} (expected {', '.join(FLAVOURS)})")


def flavour_folder(version: str, flavour: str) -> str:
    """The cache folder name of a build: the native one keeps the plain version (builds made
    before flavours existed are found as they are)."""
    return version if flavour == "native" else f"{version}-{flavour}"


AMX_PROBE_C = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 2;
    struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; }
        __attribute__((packed)) cfg;
    static int8_t a[16 * 64], b[16 * 64];
    static int32_t c[16 * 16];
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_zero(0);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0];
}
"""


@functools.lru_cache(maxsize=1)
def amx_instructions_run() -> bool:
    """Whether AMX tile instructions run here: the kernel grants the tile state and an int8 tile
    product does not trap. False where no C compiler takes -mamx-int8 (then nothing built here
    would use AMX either)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory(prefix="amx-probe-") as d:
        src, exe = Path(d) / "probe.c", Path(d) / "probe"
        src.write_text(AMX_PROBE_C)
        r = subprocess.run([cc, "-O1", "-mamx-tile", "-mamx-int8", str(src), "-o", str(exe)], capture_output=True)
        if r.returncode != 0:
            return False
        try:
            return subprocess.run([str(exe)], capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False
