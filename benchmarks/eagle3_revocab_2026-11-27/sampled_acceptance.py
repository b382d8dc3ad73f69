import sys, numpy as np, torch
from pathlib import Path
from arborspec.models.registry import load_model
from arborspec.models.eagle3 import eagle3_folder, load_eagle3
from arborspec.tools.train.eagle3_train import ttt_forward
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.kvcache import KVCache
torch.set_num_threads(2)
folder = Path.home() / ".cache/arborspec/eagle3-heldout/d49027c76811c1ccc534"
loaded = load_model("smollm2-135m"); m = loaded.module.eval()
embed = m.model.embed_tokens.weight.detach()
tokens = np.load(folder / "tokens.npy"); spans = np.load(folder / "spans.npy")
feats = np.load(folder / "features.npy", mmap_mode="r")
N, W = tokens.shape; V = m.config.vocab_size
eng = TorchEngine(m)
head = load_eagle3(eagle3_folder(sys.argv[1] if len(sys.argv) > 1 else "eagle3", "smollm2-135m"), m.config).float().eval()
tmap = head.token_map().long()
TAUS = [0.65, 0.7, 0.75, 0.8, 1.0]; D = 4
acc = {T: {tau: np.zeros((D, 2)) for tau in TAUS} for T in (0.8, 1.0)}
with torch.inference_mode():
    for i in range(N):
        c = KVCache(eng.info.cache, W + 1, 1)
        ids = torch.from_numpy(tokens[i : i + 1].astype(np.int64))
        tl = eng.forward(ids, torch.arange(W)[None], torch.ones(W, W, dtype=torch.bool).tril()[None], c)[0].float()
        fe = torch.from_numpy(feats[i : i + 1].astype(np.float32))
        outs = ttt_forward(head, embed, ids, fe, D)
        s, e = int(spans[i, 0]), int(spans[i, 1])
        for d, hl in enumerate(outs):
            hl = hl[0]; n = hl.shape[0]
            js = torch.tensor([j for j in range(n) if max(s, s - 1 + d + 1) <= j + 2 + d < e])
            if len(js) == 0: continue
            tgt = tl[js + 1 + d]
            for T in acc:
                p = torch.softmax(tgt / T, -1)
                for tau in TAUS:
                    q = torch.zeros(len(js), V); q[:, tmap] = torch.softmax(hl[js] / (T * tau), -1)
                    acc[T][tau][d] += [float(torch.minimum(p, q).sum(-1).sum()), len(js)]
for T in acc:
    for tau in TAUS:
        a = acc[T][tau][:, 0] / acc[T][tau][:, 1]
        print(f"T={T} tau={tau}: alpha per depth {np.round(a, 4).tolist()}  chain-4 expected {1 + np.cumprod(a).sum():.4f}")
