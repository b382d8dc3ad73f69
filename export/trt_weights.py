"""The weights of an ONNX graph handed to TensorRT's parser from read-only file mappings, and
given back to the page cache while the builder runs.

Role in one decode step: none at run time; it bounds `arborspec build`'s memory. TensorRT's
parser maps a graph's external data itself and the builder reads every page of it once while
it converts the weights: the pages it has read stay in the process's resident set (2.2 GiB of
a 1B fp16 graph, beside the builder's own 4 GiB) until the build ends. Here the graph's
`<model>.data` files are mapped by us, each initialiser is passed to the parser by address
(`load_model_proto` + `load_initializer`, TensorRT >= 10.13 and TensorRT-RTX), and a thread
drops the mapping's resident pages every 0.2 s during the build (`madvise(MADV_DONTNEED)` on a
read-only shared mapping: a page read again is read again from the file, the same bytes). Measured
at the 1B shape: benchmarks/RESULTS.md "The TensorRT path at 1B-8B".
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from pathlib import Path

RELEASE_EVERY_S = 0.2


class MappedWeights:
    """The external data files of one ONNX graph, mapped read-only, and its initialisers' places."""

    def __init__(self, onnx_path: str | Path):
        import onnx
        from onnx.external_data_helper import uses_external_data

        self.path = Path(onnx_path)
        self.model = onnx.load(str(self.path), load_external_data=False)
        self.maps: dict[str, tuple] = {}
        self.places: list[tuple[str, str, int, int]] = []  # (initialiser, file, offset, length)
        for t in self.model.graph.initializer:
            if uses_external_data(t):
                d = {e.key: e.value for e in t.external_data}
                self.places.append((t.name, d["location"], int(d.get("offset", 0)), int(d["length"])))

    def load_into(self, parser) -> bool:
        """load_model_proto + one load_initializer a tensor; then parse_model_proto."""
        import numpy as np

        if not parser.load_model_proto(self.model.SerializeToString(), str(self.path)):
            return False
        for name, location, offset, length in self.places:
            if location not in self.maps:
                f = open(self.path.parent / location, "rb")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self.maps[location] = (f, mm, np.frombuffer(mm, np.uint8).ctypes.data)
            if not parser.load_initializer(name, self.maps[location][2] + offset, length):
                return False
        del self.model  # the proto is the parser's now
        return parser.parse_model_proto()

    def close(self) -> None:
        """Unmap (after the build: the parser and the network may hold the addresses until then)."""
        for f, mm, _ in self.maps.values():
            mm.close()
            f.close()
        self.maps.clear()

    def release(self) -> None:
        for _, mm, _ in self.maps.values():
            mm.madvise(mmap.MADV_DONTNEED)

    @contextlib.contextmanager
    def releasing(self):
        """While the body runs (the build), give the mapped pages back every RELEASE_EVERY_S."""
        stop = threading.Event()

        def loop():
            while not stop.wait(RELEASE_EVERY_S):
                self.release()

        thread = threading.Thread(target=loop, name="arborspec-weights-release", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def mapped_weights(onnx_path: str | Path, parser) -> MappedWeights | None:
    """A MappedWeights where the graph has external data and the parser takes initialisers by
    address (mmap.madvise exists: Python >= 3.8 on Linux), else None (parse_from_file)."""
    if not hasattr(parser, "load_initializer") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    p = Path(onnx_path)
    if not any(p.parent.glob(p.name + "*.data")):
        return None
    m = MappedWeights(p)
    return m if m.places else None
