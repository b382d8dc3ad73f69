"""Where the exporter reads a model's tensors from: one tensor at a time, never the whole model.

Role in one decode step: none at run time. The ONNX graph builder (export/gqa_graph.py) asks a
`Weights` object for one tensor when it writes the initialiser that holds it, and drops it after,
so an export's peak memory is a small multiple of the largest layer, not of the model
(docs/models.md, "Large models").

* `ModuleWeights`: an already loaded PyTorch module (small models, the drafts built from the
  target, tests);
* `SafetensorsWeights`: a Hugging Face folder (`model.safetensors` or the shards of
  `model.safetensors.index.json`), bf16 / fp16 / fp32, each tensor read from its shard and
  converted to float32 alone;
* `GGUFWeights`: a GGUF file (memory-mapped by the `gguf` package); `linear()` gives the
  block-quantised linear layers as MatMulNBits blocks where they can be carried exactly (Q4_0, Q4_1,
  Q8_0 and the K-quants Q4_K, Q5_K, Q6_K: export/quantize.py) and `get()` any tensor dequantised.

All three speak Hugging Face names (`model.layers.3.self_attn.q_proj.weight`) in the [out, in]
orientation of nn.Linear, as the builder does.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Protocol

import numpy as np

from arborspec.runtime.errors import InputError, MissingFileError


class Weights(Protocol):
    config: object

    def get(self, name: str) -> np.ndarray: ...  # float32, [out, in] for linear layers

    def has(self, name: str) -> bool: ...

    def linear(self, name: str): ...  # export.quantize.NBits or None (float)

    def release(self) -> None: ...  # drop what was read so far from the process's memory


class ModuleWeights:
    """The tensors of a loaded module (models/llama.LlamaDecoder or gemma3), by state_dict name."""

    def __init__(self, module):
        self.module, self.config = module, module.config
        self._sd = module.state_dict()

    def get(self, name: str) -> np.ndarray:
        return self._sd[name].detach().float().cpu().contiguous().numpy()

    def has(self, name: str) -> bool:
        return name in self._sd

    def linear(self, name: str):
        return None

    def release(self) -> None:
        pass


class SafetensorsWeights:
    """A Hugging Face folder's tensors, read one at a time from its (sharded) safetensors."""

    def __init__(self, folder: str | Path, config=None):
        from arborspec.models.hf_loader import config_from_hf, weight_files

        self.folder = Path(folder)
        cfg_file = self.folder / "config.json"
        if not cfg_file.is_file():
            raise MissingFileError(f"{self.folder}: no config.json (not a Hugging Face model folder)")
        self.hf = json.loads(cfg_file.read_text())
        self.config = config or config_from_hf(self.hf, name=self.hf.get("_name_or_path") or self.folder.name)
        self.files = weight_files(self.folder)
        self._where = self._index()
        if self.config.family == "llama" and "lm_head.weight" not in self._where and not self.config.tie_embeddings:
            raise InputError(f"{self.folder}: tie_word_embeddings is false but there is no lm_head.weight")

    def _index(self) -> dict[str, Path]:
        from safetensors import safe_open

        where = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                where.update({k: f for k in st.keys()})
        return where

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        if name not in self._where:
            raise InputError(f"{self.folder}: the checkpoint has no tensor {name}")
        # opened per tensor: the shard's mapping (and the pages it touched) goes with the `with`
        with safe_open(str(self._where[name]), framework="pt") as st:
            return st.get_tensor(name).float().numpy()

    def linear(self, name: str):
        return None

    def release(self) -> None:
        pass


class GGUFWeights:
    """A GGUF file's tensors by Hugging Face name: dequantised (`get`) or as carried blocks
    (`linear`)."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        from arborspec.models.gguf_loader import gguf_config

        self.path = Path(path)
        if not self.path.is_file():
            raise MissingFileError(f"{self.path}: no such GGUF file")
        self.reader = GGUFReader(str(self.path))
        self.config, self.meta = gguf_config(self.reader, self.path)
        from .quantize import GGUFBlocks

        self.blocks = GGUFBlocks(self.reader, self.config.n_heads, self.config.n_kv_heads)

    def has(self, name: str) -> bool:
        from arborspec.models.gguf_loader import gguf_name

        try:
            return gguf_name(name) in self.blocks.tensors  # a tied head has no output.weight
        except KeyError:
            return False

    def get(self, name: str) -> np.ndarray:
        from arborspec.models.gguf_loader import dequantized_tensor, gguf_name

        t = self.blocks.tensors.get(gguf_name(name))
        if t is None:
            raise InputError(f"{self.path}: no tensor for {name}")
        return dequantized_tensor(t, self.config, self.blocks.permuted)

    def linear(self, name: str):
        return self.blocks.linear(name)

    def release(self) -> None:
        """Give back the pages of the memory-mapped file read so far (they count as resident
        memory until then; the next read maps them again)."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)


def open_weights(spec) -> Weights | None:
    """A streaming source for a model spec (a HF folder, a .gguf file, a registry name), or None
    where the model needs the in-memory path (other families, fused checkpoints, nanoGPT)."""
    if not isinstance(spec, (str, Path)):
        return None
    from arborspec.models.registry import smollm2_path

    spec_s = str(spec)
    path = smollm2_path() if spec_s == "smollm2-135m" else Path(spec_s).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        hf = json.loads((path / "config.json").read_text())
        if hf.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2"):
            return None
        return SafetensorsWeights(path)
    if path.is_file() and path.suffix == ".gguf":
        w = GGUFWeights(path)
        if w.config.family != "llama" or w.blocks.fused:
            return None
        return w
    return None
