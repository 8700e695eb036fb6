"""Method configurations: ``eviction[+channel]`` names as in the paper (``snapkv+spark``), built into pipelines."""

from spark_bench.methods.builtin import CHANNEL_METHODS, EVICTION_METHODS, METHOD_NAMES
from spark_bench.methods.config import MethodConfig
from spark_bench.methods.pipeline import Pipeline

__all__ = ["CHANNEL_METHODS", "EVICTION_METHODS", "METHOD_NAMES", "MethodConfig", "Pipeline"]
