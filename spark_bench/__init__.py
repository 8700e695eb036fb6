"""spark-bench: a reference harness for KV-cache channel pruning (SparK) and token eviction."""

__version__ = "0.1.0"
