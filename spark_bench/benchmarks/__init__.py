"""Benchmarks: each task family in its own module, producing tokenized :class:`Sample` objects."""
