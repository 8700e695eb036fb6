"""LeanK's two-stage training of a static key-channel mask (``spark-bench-leank``): :mod:`.train` the loop,
:mod:`.command` the console script. The mask it writes is what ``method=leank leank.mask=<file>`` runs
(:mod:`spark_bench.methods.channel.leank`)."""
