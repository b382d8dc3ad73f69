"""The arithmetic's floor on this CPU: one target call's matrix products as int8 GEMMs (u8
activations x s8 weights, int32 sums: AVX-512 VNNI `_mm512_dpbusd_epi32`), every linear layer of a
Llama shape plus the LM head, T rows, both cores (OpenMP), compiled by gcc at run time.

    python benchmarks/int8_floor.py --shape llama-3.2-1b --tokens 1,2,4,8,16,64
    python benchmarks/int8_floor.py --shape smollm2-135m --peak

What it is: a register-blocked kernel (6 rows x 64 columns: 24 accumulators), weights pre-packed
once ([N/16][K/4][16][4] bytes: one zmm per 4 input channels of 16 output columns), each 64-column
weight block loaded from memory once per call and reused from L1/L2 for every block of 6 rows. No attention, no norms, no activation
quantisation, no logits copy: only what the weights cost. Weights are int8 (one byte a weight):
at T = 1 that reads twice the bytes of an int4 export, so its T = 1 figure is a bandwidth figure,
not a lower bound for int4 weights; the cost of a row past the first (c(T) - c(1)) is the number
that matters (issue 66). `--peak`: a loop of independent dpbusd on both cores (TOPS; 2 ops a MAC).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

C_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* C[T][N] = A[T][K] (u8) x W (s8, packed [N/16][K/4][16][4]); R rows x 4 column strips of 16 per
   register block (R <= 6: 24 accumulators, 4 weight registers, 1 broadcast); ROWS_R is generated
   with one named variable per accumulator (an array of them spills to the stack under gcc) */
ROWS_FUNCTIONS
typedef void (*rows_fn)(const uint8_t *, int, const int8_t *, int32_t *, int, int);
static rows_fn ROWS[7] = {0, rows1, rows2, rows3, rows4, rows5, rows6};

static void gemm(int T, int K, int N, const uint8_t *A, const int8_t *W, int32_t *C) {
    #pragma omp parallel for schedule(static)
    for (int nb = 0; nb < N / 16; nb += 4) {  /* N is a multiple of 64 in every shape here */
        const int8_t *w = W + (size_t)nb * K * 16;
        for (int t0 = 0; t0 < T; t0 += 6) {
            int r = T - t0 < 6 ? T - t0 : 6;
            ROWS[r](A + (size_t)t0 * K, K, w, C + (size_t)t0 * N, N, nb);
        }
    }
}

static double peak(double seconds) {  /* TOPS of independent dpbusd chains on every thread */
    double ops = 0, t0 = now(), t;
    long iters = 0;
    do {
        #pragma omp parallel reduction(+:ops)
        {
            __m512i a[12], x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x01020304);
            for (int i = 0; i < 12; i++) a[i] = _mm512_setzero_si512();
            for (long n = 0; n < 1000000; n++)
                for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
            volatile int sink = 0;
            for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(a[i]);
            ops += 1000000.0 * 12 * 64 * 2;
        }
        iters++;
        t = now();
    } while (t - t0 < seconds);
    return ops / (t - t0) / 1e12;
}

/* argv: reps, then T list ("1,2,4"), then K N count triples: prints "T min_ms median_ms" per T */
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--peak") == 0) { printf("peak_tops %.4f\n", peak(2.0)); return 0; }
    int reps = atoi(argv[1]);
    int nm = (argc - 3) / 3, Ts[64], nt = 0, Tmax = 0;
    for (char *s = strtok(argv[2], ","); s; s = strtok(NULL, ",")) { Ts[nt] = atoi(s); if (Ts[nt] > Tmax) Tmax = Ts[nt]; nt++; }
    int K[64], N[64], cnt[64]; int8_t *W[64][64]; size_t Kmax = 0, Nmax = 0;
    for (int m = 0; m < nm; m++) {
        K[m] = atoi(argv[3 + 3 * m]); N[m] = atoi(argv[4 + 3 * m]); cnt[m] = atoi(argv[5 + 3 * m]);
        if ((size_t)K[m] > Kmax) Kmax = K[m];
        if ((size_t)N[m] > Nmax) Nmax = N[m];
        for (int c = 0; c < cnt[m]; c++) {  /* one copy per layer: every call reads all the weights */
            W[m][c] = aligned_alloc(64, (size_t)K[m] * N[m]);
            for (size_t i = 0; i < (size_t)K[m] * N[m]; i++) W[m][c][i] = (int8_t)((i * 2654435761u) >> 24);
        }
    }
    uint8_t *A = aligned_alloc(64, (size_t)Tmax * Kmax);
    for (size_t i = 0; i < (size_t)Tmax * Kmax; i++) A[i] = (uint8_t)(i * 40503u >> 8);
    int32_t *C = aligned_alloc(64, (size_t)Tmax * Nmax * 4);
    for (int ti = 0; ti < nt; ti++) {
        double best[64];
        for (int r = 0; r < reps + 1; r++) {
            double t0 = now();
            for (int c = 0; c < 64; c++)
                for (int m = 0; m < nm; m++)
                    if (c < cnt[m]) gemm(Ts[ti], K[m], N[m], A, W[m][c], C);
            if (r) best[r - 1] = now() - t0;  /* the first pass warms up */
        }
        for (int i = 0; i < reps; i++)  /* sort: the fastest (the floor) and the median */
            for (int j = i + 1; j < reps; j++) if (best[j] < best[i]) { double x = best[i]; best[i] = best[j]; best[j] = x; }
        printf("%d %.4f %.4f\n", Ts[ti], 1e3 * best[0], 1e3 * best[reps / 2]);
    }
    return 0;
}
"""

# hidden, layers, heads, kv_heads, head_dim, intermediate, vocab
SHAPES = {
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152),
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 49152),
    "llama-3.2-3b": (3072, 28, 24, 8, 128, 8192, 49152),
}


def matrices(shape: str) -> list[tuple[int, int, int]]:
    """(K, N, how many) of every linear layer of one call: q, k+v, o, gate+up, down per layer, the LM head."""
    h, layers, heads, kv, hd, inter, vocab = SHAPES[shape]
    return [(h, heads * hd, layers), (h, 2 * kv * hd, layers), (heads * hd, h, layers), (h, 2 * inter, layers),
            (inter, h, layers), (h, vocab, 1)]  # fmt: skip


def _rows_function(r: int) -> str:
    """C source of rows{r}: r rows x 4 strips, accumulators as named registers."""
    acc = [f"a{i}_{c}" for i in range(r) for c in range(4)]
    body = [f"static void rows{r}(const uint8_t *A, int K, const int8_t *w, int32_t *C, int N, int nb) {{"]
    body += [
        "    const size_t s = (size_t)K * 16;",
        "    __m512i " + ", ".join(f"{a} = _mm512_setzero_si512()" for a in acc) + ";",
    ]
    body += ["    for (int k = 0; k < K; k += 4) {", "        const int8_t *p = w + (size_t)k * 16;"]
    body += [f"        __m512i w{c} = _mm512_load_si512((const void *)(p + {c} * s));" for c in range(4)]
    for i in range(r):
        body.append(f"        __m512i b{i} = _mm512_set1_epi32(*(const int32_t *)(A + (size_t){i} * K + k));")
        body += [f"        a{i}_{c} = _mm512_dpbusd_epi32(a{i}_{c}, b{i}, w{c});" for c in range(4)]
    body.append("    }")
    for i in range(r):
        body += [
            f"    _mm512_storeu_si512((void *)(C + (size_t){i} * N + (nb + {c}) * 16), a{i}_{c});" for c in range(4)
        ]
    return "\n".join(body + ["}"])


def c_source() -> str:
    return C_SOURCE.replace("ROWS_FUNCTIONS", "\n".join(_rows_function(r) for r in range(1, 7)))


def build(work: Path) -> Path:
    cc = shutil.which("gcc")
    if cc is None:
        raise SystemExit("int8_floor: gcc is not installed")
    src, exe = work / "int8_floor.c", work / "int8_floor"
    src.write_text(c_source())
    flags = ["-O3", "-march=native", "-mavx512f", "-mavx512vnni", "-fopenmp"]
    subprocess.run([cc, *flags, str(src), "-o", str(exe)], check=True)
    return exe


def floor_curve(shape: str, tokens: list[int], reps: int = 5, threads: int = 2) -> dict[int, float]:
    """{T: ms} of every linear layer of one call of `shape` as int8 GEMMs: the fastest of reps (a
    floor; on a shared machine the median measures the neighbours)."""
    with tempfile.TemporaryDirectory(prefix="int8-floor-") as d:
        exe = build(Path(d))
        args = [str(reps), ",".join(map(str, tokens))] + [str(x) for m in matrices(shape) for x in m]
        out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True, env=_env(threads)).stdout
    return {int(t): float(lo) for t, lo, _med in (ln.split() for ln in out.splitlines())}


def _env(threads: int) -> dict:  # passive waits: spinning OpenMP barriers collapse on a shared machine
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE", "PATH": "/usr/bin:/bin"}


def peak_tops(threads: int = 2) -> float:
    with tempfile.TemporaryDirectory(prefix="int8-floor-") as d:
        exe = build(Path(d))
        out = subprocess.run([str(exe), "--peak"], check=True, capture_output=True, text=True, env=_env(threads)).stdout
    return float(out.split()[1])


def gop_per_row(shape: str) -> float:
    return sum(2 * k * n * c for k, n, c in matrices(shape)) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak", action="store_true", help="also the dpbusd peak (TOPS)")
    a = ap.parse_args(argv)
    out = {"shape": a.shape, "gop_per_row": gop_per_row(a.shape)}
    if a.peak:
        out["peak_tops"] = peak_tops(a.threads)
    out["ms"] = floor_curve(a.shape, [int(t) for t in a.tokens.split(",")], a.reps, a.threads)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
