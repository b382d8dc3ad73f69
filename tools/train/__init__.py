"""Training drafts: distillation corpus/draft/evaluation, the EAGLE-3 corpus and head training."""
