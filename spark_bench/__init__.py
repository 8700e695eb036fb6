"""spark-bench: a reference harness for KV-cache channel pruning (SparK) and token eviction, and SparK as a library.

The library (:mod:`spark_bench.api`): ``method`` (a config from the command line's names and options), ``prompt``
(token ids with their parts), ``compress`` (one prefill → compact stores with their true bytes), ``generate``
(``model.generate`` continued from them), ``ask`` (several questions over one compressed context), ``answer_nll``
(a reference answer's likelihood through a compressed cache) and ``load`` (a model of ``conf/model/``). They are imported on first use, so ``import spark_bench`` (and the command line's cheap
start-up checks) do not load torch.
"""

__version__ = "0.1.0"

__all__ = ["CompressedContext", "SparkCache", "answer_nll", "ask", "compress", "generate", "load", "method", "press",
           "prompt"]


def __getattr__(name: str):
    if name in __all__:
        from spark_bench import api

        return getattr(api, name)
    raise AttributeError(f"module 'spark_bench' has no attribute {name!r}")
