"""Tokens a call of the sampled-tuned tree with its candidates (T = 0.8, top-p 0.95) on an export
for several EAGLE-3 sample scales s (sampled candidates come from q = softmax(s * logits / T)):
every packaged prompt (8 x 96 tokens) decoded with each s in turn, SEEDS times; the line after
each seed is cumulative. Output of the nineteenth session (fp32 export, run 18's head):
sample_scale.txt beside this file.

    .venv/bin/python benchmarks/history/sampled_tune_2026-11-28/sample_scale.py EXPORT_DIR 6 1.0,1.3333333,1.6666667,2.0
"""

import sys

import arborspec
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.export_dir import open_export
from arborspec.runtime.sampling import SamplingParams
from arborspec.runtime.trees import parse_tree_spec
from arborspec.tools import prompts as prompt_sets

E, seeds, scales = sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3].split(",")]
arborspec.enable_shared_pool()
ex = open_export(E, "onnxruntime", "cpu")
entries, _ = prompt_sets.read_prompts_file(None)
prompts = [p["ids"] for p in prompt_sets.encode_prompts(prompt_sets.select_prompts(entries, 8), ex.tokenizer)]
eos = list(ex.tokenizer.meta.get("eos_token_ids") or [])
sp = SamplingParams(0.8, 0, 0.95)
pol = parse_tree_spec(f"static:{E}/tree_auto.sampled.json")
dec = SpeculativeDecoder(ex.target, ex.draft, tree=pol, sampling=sp)
print("candidates", dec.candidates, pol.paths, flush=True)
res = {s: [0, 0] for s in scales}
for seed in range(seeds):
    for i, p in enumerate(prompts):
        for s in scales:
            ex.draft.sample_scale = s
            st = dec.generate(p, 96, eos, seed=1000 * seed + i).stats
            res[s][0] += st.new_tokens
            res[s][1] += st.steps
    print(seed, {s: round(t / n, 3) for s, (t, n) in res.items()}, flush=True)
