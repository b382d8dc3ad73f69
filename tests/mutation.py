"""Mutation check: every named mutant (tests/mutants.py) must be killed by its fast tests.

Each mutant is applied to a temporary copy of the repository (never in place): the tracked
and untracked (not ignored) files are copied, the installed package is pointed at the copy
(a sitecustomize on PYTHONPATH remaps the editable install), the mutant's tests run there,
and the mutant is `killed` when they fail. Exits 1 when any mutant survived (or its snippet is
no longer in its file). Usage: python tests/mutation.py [-k SUBSTRING] [-j JOBS]
(`make mutants`)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from mutants import MUTANTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = """import os
try:
    import __editable___arborspec_0_1_0_finder as f
    src = os.path.dirname(f.MAPPING["arborspec.runtime"])
    dst = os.environ["ARBORSPEC_MUTANT_TO"]
    for k, v in list(f.MAPPING.items()):
        f.MAPPING[k] = os.path.join(dst, os.path.relpath(v, src))
except ImportError:
    pass
"""


def copy_tree(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def run_mutant(m) -> tuple[str, float, str]:
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="arborspec-mutant-") as tmp:
        tmp = Path(tmp)
        copy_tree(tmp)
        path = tmp / m.file
        src = path.read_text()
        if src.count(m.snippet) != 1:
            return "stale", time.time() - t0, f"snippet found {src.count(m.snippet)} times in {m.file}"
        path.write_text(src.replace(m.snippet, m.replacement))
        (tmp / ".mutant-pp").mkdir()
        (tmp / ".mutant-pp" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = dict(os.environ, PYTHONPATH=str(tmp / ".mutant-pp"), ARBORSPEC_MUTANT_TO=str(tmp))
        check = subprocess.run(
            [sys.executable, "-c", "import arborspec.runtime as r; print(r.__file__)"],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp,
        ).stdout.strip()
        if not check.startswith(str(tmp)):
            return "error", time.time() - t0, f"the copy is not what imports: {check}"
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
        status = "killed" if r.returncode == 1 else ("survived" if r.returncode == 0 else "error")
        return status, time.time() - t0, tail[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="run only mutants whose name contains this")
    ap.add_argument("-j", type=int, default=1, help="mutants run at once")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k.lower() in m.name.lower()]
    t0 = time.time()
    with ThreadPoolExecutor(args.j) as pool:
        results = list(pool.map(lambda m: (m, *run_mutant(m)), chosen))
    print("| mutant | file | status | seconds |\n|---|---|---|---|")
    for m, status, secs, note in results:
        print(f"| {m.name} | {m.file} | {status} | {secs:.0f} |" + ("" if status == "killed" else f" {note}"))
    bad = [m for m, status, _, _ in results if status != "killed"]
    print(f"{len(results) - len(bad)}/{len(results)} killed in {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
