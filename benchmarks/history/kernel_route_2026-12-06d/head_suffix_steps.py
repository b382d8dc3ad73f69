"""Per request: prompt ids, output ids, and per step the tokens it committed (head + suffix, tuned tree)."""

import json

import torch

import arborspec
from arborspec.runtime.drafts import suffix

arborspec.enable_shared_pool()
torch.set_num_threads(1)
V24 = "/root/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24"
P = json.load(open("/work/logs/kinds24.json"))["prompts"]
steps = []
orig = suffix.SuffixMixDraft.commit


def commit(self, tree, path, features=None):
    steps.append(int(path.numel()))
    return orig(self, tree, path, features)


suffix.SuffixMixDraft.commit = commit
g = arborspec.Generator.from_export(V24, draft="export+suffix", tree="chain:1")
out = []
for p in P:
    steps.clear()
    from arborspec.runtime.chat import chat_messages, render_chat

    text = (
        render_chat(g.tokenizer, chat_messages([{"role": "user", "content": p["text"]}]), None)
        if p.get("chat")
        else p["text"]
    )
    PIDS = g.encode_prompt(text)
    c = g.generate(p["text"], max_new_tokens=128, ignore_eos=True, chat=bool(p.get("chat")))
    out.append(dict(id=p["id"], kind=p["category"], tokens=list(c.tokens), steps=list(steps), prompt_ids=PIDS))
json.dump(out, open("head_suffix_steps.json", "w"))
print(len(out), sum(len(o["steps"]) for o in out))
