"""The data path: prefill once, compress per method config, greedy-decode."""
