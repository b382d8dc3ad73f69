"""Polygraphy comparisons of an export folder: the feeds, the runners, the comparison."""
