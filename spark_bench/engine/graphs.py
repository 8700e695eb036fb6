"""What a decode step of a :class:`~spark_bench.engine.cache.BatchedCache` needs to be captured in a CUDA graph and
replayed (:class:`~spark_bench.engine.decode.StepGraph` captures and replays it): whether it can be
(:meth:`GraphSteps.graph_blocker`), and the host-side tail lengths kept in step with the device-held ones a replay
advances (capture runs the Python once and no kernel; a replay runs the kernels and no Python), or rewound so a
step can run again over the same tail slots (a replay checked against its eager step, :mod:`~.fastpaths`).

:class:`GraphSteps` is a mixin of ``BatchedCache``: it reads the cache's ``layers`` (each a ``BatchedLayer``:
``backend``, ``kernel_writes_tail``, ``tail_keys``, ``length``, ``length_t``) and ``fast_paths``. It imports nothing
from the cache module.
"""

from __future__ import annotations


class GraphSteps:
    """CUDA-graph support of a decode batch (mixed into :class:`~spark_bench.engine.cache.BatchedCache`)."""

    def graph_blocker(self) -> str | None:
        """Why a decode step of this batch cannot be captured in a CUDA graph (None: it can): graphs not switched
        off in this run (a replay differed from its eager step); every layer on one device (a graph captures one
        device's stream: under a device map the layers' launches go to several); every layer running the fused
        kernel (static shapes, the tail length on the device) with no row on the per-row path (its tail is sliced at
        the host's length), on CUDA."""
        if not self.fast_paths.on("graph"):
            return f"graphs are off in this run ({self.fast_paths.off['graph']} differed from its eager step)"
        devices = list(dict.fromkeys(layer.tail_keys.device for layer in self.layers))
        if len(devices) > 1:
            return f"the layers span {len(devices)} devices ({', '.join(map(str, devices))})"
        for layer in self.layers:
            if layer.backend != "triton":
                return f"layer on the {layer.backend} backend (graphs need the fused CUDA kernel)"
            if not layer.kernel_writes_tail:
                return "rows on the per-row path or out of order (their tail is written at the host-side length)"
            if not layer.tail_keys.is_cuda:
                return "the batch is not on a CUDA device"
        return None

    def advance(self, n: int) -> None:
        """A replayed step wrote ``n`` tokens on the device: advance the host-side lengths to match."""
        for layer in self.layers:
            layer.length += n

    def rewind(self, n: int) -> None:
        """Undo a step of ``n`` tokens the fused kernels wrote (host and device lengths), so the same step can run
        again over the same tail slots (a replay checked against an eager step, :mod:`~.fastpaths`)."""
        for layer in self.layers:
            layer.length -= n
            layer.length_t.sub_(n)

    def host_lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]

    def set_host_lengths(self, lengths: list[int]) -> None:
        for layer, n in zip(self.layers, lengths):
            layer.length = n
