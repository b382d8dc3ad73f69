"""Tree tuning (Sequoia): measured acceptance and cost curves, the tree DP, the tuner."""
