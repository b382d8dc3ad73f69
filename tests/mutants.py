"""Named mutants of the code that carries the exactness promise: accept rules, warping, tree
masks and positions, KV commit, batched rows. Each is (name, file, exact source snippet,
replacement, the fast tests that must kill it). `tests/mutation.py` applies them one at a time
in a temporary copy of the tree; tests/runtime/test_negative_controls.py applies the accept-rule ones
in process. File paths are relative to the repository root: where a module moves, change its
path here (and only here)."""

from __future__ import annotations

from dataclasses import dataclass

ACCEPT = "runtime/accept.py"
SAMPLING = "runtime/sampling.py"
DRAFTING = "runtime/drafts/tree_builder.py"
TREE_PLAN = "runtime/tree_plan.py"
KVCACHE = "runtime/kvcache.py"
BATCH = "runtime/batch_decode.py"
DRAFTS = "runtime/drafts/model.py"
EAGLE3 = "runtime/drafts/eagle3.py"
DECODE = "runtime/decode.py"
STEP = "runtime/step.py"  # the steps both decoders share (decode.py, batch_decode.py)
PENALTIES = "runtime/penalties.py"
STRUCTURED = "runtime/structured.py"

EXACT = "tests/runtime/test_exact_lossless.py"
NEG = "tests/runtime/test_negative_controls.py"
WARP = "tests/runtime/test_warping.py"
GREEDY = "tests/runtime/test_decode_greedy.py"
KV = "tests/runtime/test_kv_exact.py"
PRIMS = "tests/runtime/test_random_primitives.py"  # the exact tests enumerate the primitives: checked here
BATCH_T = "tests/runtime/test_batch_decode.py"
EAGLE3_T = "tests/models/test_eagle3.py"
PREFIX_T = "tests/runtime/test_prefix_cache.py"
LOGPROBS_T = "tests/runtime/test_logprobs.py"
PENALTIES_T = "tests/runtime/test_penalties.py"
STRUCTURED_T = "tests/runtime/test_structured.py"
GOVERNOR_T = "tests/runtime/test_governor.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    snippet: str
    replacement: str
    tests: tuple  # pytest arguments: files / node ids, and -k expressions


MUTANTS = [
    # ---- accept rules (the planted bugs first)
    Mutant(
        "sampled accepted when p/q >= 0.5, no draw",
        ACCEPT,
        "qx > 0 and coin(min(1.0, float(p[x]) / qx), rng)",
        "qx > 0 and float(p[x]) / qx >= 0.5",
        (EXACT, "-k", "one_step and model-sample-fork"),
    ),
    Mutant(
        "residual not updated after a rejection",
        ACCEPT,
        "p = _renorm(torch.clamp(p - q, min=0.0), fallback=p)",
        "pass",
        (EXACT, "-k", "one_step and model-sample-fork"),
    ),
    Mutant(
        "topk keeps the rejected token",
        ACCEPT,
        "                p[x] = 0.0\n                p = _renorm(p)",
        "                pass",
        (EXACT, "-k", "generations and model-full"),
    ),
    Mutant(
        "sample-unique keeps the rejected token in q",
        ACCEPT,
        "                    q[x] = 0.0\n                    q = _renorm(q)",
        "                    pass",
        (EXACT, "-k", "one_step and model-sample-unique-fork"),
    ),
    Mutant(
        "topk: depth >= 3 accepted unconditionally",
        ACCEPT,
        "if coin(float(p[x]), rng):",
        "if coin(float(p[x]), rng) or int(tree.depth[c]) >= 3:",
        (EXACT, "-k", "generations and model-full"),
    ),
    Mutant(
        "sampled: depth >= 3 accepted unconditionally",
        ACCEPT,
        "if qx > 0 and coin(",
        "if int(tree.depth[c]) >= 3 or qx > 0 and coin(",
        (EXACT, "-k", "one_step and model-sample-fork"),
    ),
    Mutant(
        "greedy: first child accepted when its parent is",
        ACCEPT,
        "if toks[c] == a), None)",
        "if toks[c] == a or c == kids[node + 1][-1]), None)",
        (GREEDY, "-k", "every_policy"),
    ),
    # ---- warping
    Mutant(
        "top-p drops the token that crosses the threshold",
        SAMPLING,
        "drop = before >= top_p",
        "drop = before + p > top_p",
        (WARP,),
    ),
    Mutant(
        "top-p stops its search at the first 256 tokens",
        SAMPLING,
        "if k == v or bool(",
        "if k or bool(",
        (WARP,),
    ),
    Mutant(
        "top-p on the CPU drops the token that crosses the threshold",
        SAMPLING,
        "return order[(before < need) |",
        "return order[(before + p < need) |",
        (WARP,),
    ),
    Mutant(
        "top-p on the CPU keeps to the first floor's tokens",
        SAMPLING,
        "if floor == 0.0 or e[cand].sum(dtype=np.float64) >= need:",
        "if True:",
        (WARP,),
    ),
    Mutant(
        "top-p on the CPU ranks the candidates in token order",
        SAMPLING,
        'order = cand[np.argsort(-a[cand], kind="stable")]',
        "order = cand",
        (WARP,),
    ),
    Mutant(
        "CPU probabilities normalised over every token, not the kept ones",
        SAMPLING,
        "o[keep] = e[keep] / e[keep].sum(dtype=np.float64)",
        "o[keep] = e[keep] / e.sum(dtype=np.float64)",
        (WARP,),
    ),
    Mutant(
        "CPU temperature ignored",
        SAMPLING,
        "z = (a - m) / t",
        "z = a - m",
        (WARP,),
    ),
    Mutant(
        "CPU top-k keeps k - 1",
        SAMPLING,
        "z[z < kth] = -np.inf",
        "z[z <= kth] = -np.inf",
        (WARP,),
    ),
    Mutant(
        "sample never draws the last nonzero entry",
        SAMPLING,
        "support = np.flatnonzero(a != 0)",
        "support = np.flatnonzero(a != 0)[:-1]",
        (PRIMS,),
    ),
    Mutant(
        "top-k keeps k - 1",
        SAMPLING,
        'x = x.masked_fill(x < kth, float("-inf"))',
        'x = x.masked_fill(x <= kth, float("-inf"))',
        (WARP,),
    ),
    Mutant(
        "temperature ignored",
        SAMPLING,
        "/ max(sp.temperature, 1e-30)",
        "/ 1.0",
        (WARP,),
    ),
    # ---- sampled candidates
    # (drawing with replacement under the sample-unique rule is an equivalent mutant: a repeated
    # candidate has q = 0 after the first and is skipped; the output stays exact)
    Mutant(
        "sample-unique draws from q squared",
        SAMPLING,
        "torch.topk(qc / e, k",
        "torch.topk(qc * qc / e, k",
        (PRIMS,),
    ),
    Mutant(
        "sample-unique over a few rows draws from q squared",
        SAMPLING,
        "np.argsort(e / a[s], kind",
        "np.argsort(e / (a[s] * a[s]), kind",
        (PRIMS,),
    ),
    Mutant(
        "sample-unique over a few rows repeats a zero entry after the nonzero ones",
        SAMPLING,
        "np.setdiff1d(np.arange(k + s.size), s)[: k - order.size]",
        "np.zeros(k - order.size, dtype=np.int64) + int(np.setdiff1d(np.arange(k + s.size), s)[0])",
        (PRIMS,),
    ),
    Mutant(
        "sampled candidates ignore the draft's sample_scale",
        DRAFTING,
        "x = out * scale if scale != 1.0 else out",
        "x = out",
        ("tests/runtime/test_trees.py", "-k", "sample_scale"),
    ),
    Mutant(
        "sampled candidates point at the wrong q row",
        DRAFTING,
        "ws.qrow[n - m : n] = n_q + fi",
        "ws.qrow[n - m : n] = n_q",
        (EXACT, "-k", "one_step and model-sample-unique-full"),  # levels with several rows
    ),
    # ---- tree masks and positions
    Mutant(
        "siblings see each other (tree mask)",
        DRAFTING,
        "anc[new, new] = True",
        "anc[new, new] = True\n        anc[new[:, None], new[None, :]] = True",
        (EXACT, "-k", "generations and model-dynamic"),
    ),
    Mutant(
        "verify positions off by one",
        TREE_PLAN,
        "torch.add(offsets, past, out=pos[:n])",
        "torch.add(offsets, past + 1, out=pos[:n])",
        (KV, "-k", "llama-model"),  # vanilla shares the buffers: greedy equality cannot see it
    ),
    Mutant(
        "verify mask: nodes do not see their ancestors",
        TREE_PLAN,
        "block[1:, 1:].copy_(tree.anc)",
        "block[1:, 1:].copy_(torch.eye(tree.n, dtype=torch.bool))",
        (GREEDY, "-k", "every_policy"),
    ),
    # ---- KV commit
    Mutant(
        "KV commit skips the gather",
        KVCACHE,
        "        self._seq(self.k, p, p + n).copy_(self.k.index_select(d, idx))\n"
        "        self._seq(self.v, p, p + n).copy_(self.v.index_select(d, idx))\n",
        "",
        (KV,),
    ),
    Mutant(
        "KV commit gathers keys only",
        KVCACHE,
        "        self._seq(self.v, p, p + n).copy_(self.v.index_select(d, idx))\n",
        "",
        (KV,),
    ),
    Mutant(
        "draft commit keeps the chain only",
        DRAFTS,
        "src = list(range(self._chain)) + (slots[ran] + self._chain).tolist()",
        "src = list(range(self._chain))",
        (KV,),
    ),
    # ---- batched rows
    Mutant(
        "batch: every row accepts with row 0's logits",
        BATCH,
        "call.logits[b], tree, s, self.target.info.name,",
        "call.logits[0], tree, s, self.target.info.name,",
        (EXACT, "-k", "batched and topk"),
    ),
    Mutant(
        "batch: the sampled rows' root probabilities all from the first row",
        BATCH,
        "rows = torch.tensor([s.row for s in group], device=logits.device)",
        "rows = torch.tensor([group[0].row for s in group], device=logits.device)",
        (BATCH_T, "-k", "root_probabilities"),
    ),
    Mutant(
        "sampled walk: logits not checked before they become probabilities",
        ACCEPT,
        "            if check is not None:\n                check(row)\n",
        "",
        (BATCH_T, "-k", "nan_logits_while_sampling"),
    ),
    Mutant(
        "EAGLE-3 device top-k: raw logits where log-probs were asked for",
        EAGLE3,
        "t = topk_of(logits, *topk)",
        "t = topk_of(logits, topk[0], False)",
        (EAGLE3_T, "-k", "top_k_taken"),
    ),
    Mutant(
        "batch: a shorter row attends the gap",
        BATCH,
        "mask[b, :, : s.length] = True",
        "mask[b, :, :p] = True",
        (EXACT, "-k", "batched and topk"),
    ),
    # ---- prefix reuse and the prompt's log-probs
    Mutant(
        "prefix reuse keeps tokens the new prompt changed",
        KVCACHE,
        "while n < min(len(a), len(b)) and a[n] == b[n]:",
        "while n < min(len(a), len(b)):",
        (PREFIX_T, "-k", "row_invariant and vanilla and 0.0"),
    ),
    Mutant(
        "prefix reuse hands the draft the kept features one row late",
        KVCACHE,
        "torch.cat(self._feats)[:keep]",
        "torch.cat(self._feats)[:keep].roll(1, 0)",
        (PREFIX_T, "-k", "float_target"),
    ),
    Mutant(
        "the EAGLE-3 head keeps one entry more than the new sequence repeats",
        EAGLE3,
        "w, keep = w0, min(n - 1 - w0, len(self._entries))",
        "w, keep = w0, min(n - w0, len(self._entries))",
        (PREFIX_T, "-k", "eagle3_head"),
    ),
    Mutant(
        "prompt log-probs read one row early",
        STEP,
        "out.extend(token_logprobs(rows, prompt[s + 1 : s + 1 + len(rows)], k))",
        "out.extend(token_logprobs(rows, prompt[s : s + len(rows)], k))",
        (LOGPROBS_T, "-k", "prompt_logprobs_equal"),
    ),
    # ---- penalties: each verify row processed along its own tree path
    Mutant(
        "sampled walk: penalties ignore the tree path",
        ACCEPT,
        "row = process(row, tokens)",
        "row = process(row, [])",
        (EXACT, "-k", "penalised"),
    ),
    Mutant(
        "greedy walk: penalties ignore the tree path",
        ACCEPT,
        "            path_tokens.append(a)",
        "            pass",
        (PENALTIES_T, "-k", "every_mode"),
    ),
    Mutant(
        "penalties: a step's tokens never join the history",
        STEP,
        "        history.extend(new)",
        "        pass",
        (PENALTIES_T, "-k", "every_mode"),
    ),
    Mutant(
        "presence / frequency penalties count the prompt too",
        PENALTIES,
        "self.out = np.zeros(0, dtype=np.int64)  # the distinct output tokens",
        "self.out = self.seen; np.add.at(self.counts, self.seen, 1)",
        (PENALTIES_T, "-k", "every_mode or by_hand"),
    ),
    Mutant(
        "the draft's rows below the root are not penalised along their path",
        DRAFTING,
        "out = history.process_draft(out, _paths(tokens, plan.anc, lv.frontier), tmap)",
        "pass",
        (PENALTIES_T, "-k", "draft_proposes"),
    ),
    Mutant(
        "structured output: each row masked as the root's, whatever its tree path",
        STRUCTURED,
        "n = m.try_consume_tokens(path) if path else 0",
        "n, path = 0, []",
        (STRUCTURED_T, "-k", "greedy_under"),
    ),
    Mutant(
        "batch without trees: a penalised row takes the unprocessed root argmax",
        STEP,
        "            root = None  # a finite root row: the walk reads it, processed",
        "            pass",
        (PENALTIES_T, "-k", "every_mode"),
    ),
    Mutant(
        "min_tokens: a row's tree path not counted",
        PENALTIES,
        "if self.produced + len(path) >= self.n:",
        "if self.produced >= self.n:",
        (PENALTIES_T, "-k", "min_tokens"),
    ),
    Mutant(
        "min-p not applied after the nucleus on CPU rows",
        SAMPLING,
        "                keep = keep[z[keep] >= floor]",
        "                pass",
        (WARP, "-k", "min_p"),
    ),
    Mutant(
        "batch: row commit skips the gather",
        KVCACHE,
        "        r, d, s = torch.tensor([rows, dst, src], dtype=torch.long).to(self.device)",
        "        return",
        (EXACT, "-k", "batched and topk"),
    ),
    Mutant(
        "a grammar's forced chain committed to the draft as if it had drafted it",
        STEP,
        "    if not tree.forced:\n        draft.commit(tree, path, feats)",
        "    if True:\n        draft.commit(tree, path, feats)",
        (KV, "-k", "forced_chains"),
    ),
    Mutant(
        "a forced chain's root not deferred to the draft",
        STEP,
        "    for j, t in enumerate([root] + tree.tokens[path].tolist()):",
        "    for j, t in enumerate(tree.tokens[path].tolist(), 1):",
        (KV, "-k", "forced_chains"),
    ),
    Mutant(
        "a step the governor held without a tree not told to the draft",
        DECODE,
        "                self.draft.defer(seq.root, feats[0, :1] if feats is not None else None)",
        "                pass",
        (GOVERNOR_T, "-k", "in_step"),
    ),
]
