"""The paper's motivation analyses (§4.1, Appendix B, the appendix memory figure): :mod:`.saliency` (Observation 1:
per-token channel contributions, CV, top-T overlap), :mod:`.observation2` (Fig. 2c's relative losses),
:mod:`.figures` (PNGs) and :mod:`.command` (``spark-bench-saliency``, ``spark-bench-figure2``)."""
