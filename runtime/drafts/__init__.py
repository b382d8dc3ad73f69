"""Draft sources: what proposes each step's tree (step 1 of a decode step), one module each.

base          the interface: DraftSource, NodeView, TopK / topk_of, tree_capacity, vocab mapping
tree_builder  the level loop that builds one step's tree from any draft source
model         ModelDraft: a contract engine with its own cache (a small model, layers:K)
bigram        BigramDraft: the target's next-token table (no model call)
lookup        LookupDraft: prompt lookup (n-gram index of the sequence itself)
eagle3        Eagle3Draft: an EAGLE-3 head over the target's features (torch/ORT/TensorRT heads)
mixed         LookupMixDraft: a model draft mixed with lookup (BASE+lookup)
batched       BatchedModelDraft: one draft call per level for a whole batch
spec          the one `--draft` spec parser
"""
