"""Which llama.cpp build a machine gets (tools/bench/llama_build_flags.py): /proc/cpuinfo flags ->
cmake flags, the flavour where AMX is advertised and does or does not run, and the cache folder
each flavour is looked up in (no real build here: the build step is replaced)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arborspec.tools.bench import llama_build_flags as bf
from arborspec.tools.bench import llama_server as ls

# the flags lines of the machines this project runs on (abridged to what ggml's options read)
XEON_SPR = (
    "fpu sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi "
    "avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
)
EPYC_ZEN4 = (
    "fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16"
)
HASWELL = "fpu sse4_2 avx avx2 fma f16c bmi2"


def _cmake(flags: str) -> dict[str, str]:
    out = {}
    for f in bf.isa_cmake_flags(set(flags.split())):
        k, v = f[2:].split("=")
        out[k] = v
    return out


def test_cpuinfo_flags_name_the_instruction_sets_one_by_one():
    spr = _cmake(XEON_SPR)
    assert spr["GGML_NATIVE"] == "OFF"
    for opt in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX_VNNI", "GGML_AVX512"):
        assert spr[opt] == "ON", opt
    assert spr["GGML_AVX512_VNNI"] == spr["GGML_AVX512_BF16"] == spr["GGML_AVX512_VBMI"] == "ON"
    assert spr["GGML_AMX_TILE"] == spr["GGML_AMX_INT8"] == spr["GGML_AMX_BF16"] == "OFF"  # advertised, never built
    zen4 = _cmake(EPYC_ZEN4)
    assert zen4["GGML_AVX512_VNNI"] == "ON" and zen4["GGML_AVX_VNNI"] == "OFF"  # no avx_vnni flag there
    old = _cmake(HASWELL)
    assert old["GGML_AVX2"] == "ON" and old["GGML_AVX512"] == old["GGML_AVX512_VNNI"] == "OFF"
    # GGML_AVX512 compiles with -mavx512bw etc.: one missing piece turns it (and what needs it) off
    partial = _cmake(EPYC_ZEN4.replace(" avx512bw", ""))
    assert partial["GGML_AVX512"] == "OFF"
    assert _cmake("avx512_vnni")["GGML_AVX512_VNNI"] == "OFF"  # no avx512f: nothing AVX-512
    assert set(_cmake("")) == {"GGML_NATIVE"} | {o for o, _ in bf.ISA_OPTIONS} | set(bf.AMX_OPTIONS)
    assert set(_cmake("")) - {"GGML_NATIVE"} <= {k for k, v in _cmake("").items() if v == "OFF"}


def test_the_flavour_is_noamx_only_where_amx_is_advertised_and_does_not_run():
    asked = []

    def probe(result):
        return lambda: asked.append(1) or result

    assert bf.build_flavour(set(EPYC_ZEN4.split()), probe(False)) == "native" and asked == []  # not even asked
    assert bf.build_flavour(set(XEON_SPR.split()), probe(True)) == "native"  # AMX granted: native uses it
    assert bf.build_flavour(set(XEON_SPR.split()), probe(False)) == "noamx" and len(asked) == 2
    assert bf.flavour_cmake_flags("native", set()) == ["-DGGML_NATIVE=ON"]
    assert "-DGGML_AMX_INT8=OFF" in bf.flavour_cmake_flags("noamx", set(XEON_SPR.split()))
    with pytest.raises(ValueError, match="unknown llama.cpp build flavour"):
        bf.flavour_cmake_flags("fast", set())
    assert bf.flavour_folder("0.3.36", "native") == "0.3.36"  # builds made before flavours are found
    assert bf.flavour_folder("0.3.36", "noamx") == "0.3.36-noamx"


def test_the_amx_probe_runs_here():
    """Compiles and runs a few AMX instructions; where the CPU advertises no AMX they cannot run."""
    flags = ls.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    bf.amx_instructions_run.cache_clear()
    ran = bf.amx_instructions_run()
    if not set(bf.AMX_FLAGS) & flags:
        assert ran is False
    else:
        assert isinstance(ran, bool)


def _complete(root: Path) -> None:
    t = ls.LlamaCppTools.at(root, "x")
    t.server.parent.mkdir(parents=True)
    for p in (t.server, t.quantize, t.bench, t.converter):
        p.write_text("")


def test_each_flavour_is_looked_up_and_built_in_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("ARBORSPEC_LLAMA_CPP", raising=False)
    monkeypatch.setattr(ls, "pkg_version", lambda pkg: "0.3.36")
    built = []
    monkeypatch.setattr(
        ls, "_build_into_cache", lambda v, root, log, flags: built.append((root, flags)) or _complete(root)
    )
    spr, zen4 = set(XEON_SPR.split()), set(EPYC_ZEN4.split())
    native = ls.llama_cpp_tools(flags=zen4, amx_runs=pytest.fail)
    assert native.flavour == "native" and native.root == tmp_path / "llama.cpp" / "0.3.36"
    assert built[-1] == (native.root, ["-DGGML_NATIVE=ON"])
    noamx = ls.llama_cpp_tools(flags=spr, amx_runs=lambda: False)
    assert noamx.flavour == "noamx" and noamx.root == tmp_path / "llama.cpp" / "0.3.36-noamx"
    assert built[-1][0] == noamx.root and "-DGGML_AMX_TILE=OFF" in built[-1][1] and "-DGGML_AVX512=ON" in built[-1][1]
    assert ls.llama_cpp_tools(flags=spr, amx_runs=lambda: True).root == native.root  # AMX runs: the native build
    assert len(built) == 2  # found in the cache the second time
    with pytest.raises(ls.PeerUnavailable, match=r"noamx build\) is not built in"):
        monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "empty"))
        ls.llama_cpp_tools(build=False, flags=spr, amx_runs=lambda: False)
