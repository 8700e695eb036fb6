"""Token eviction methods, one per module."""
