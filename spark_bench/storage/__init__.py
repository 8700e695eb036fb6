"""Compact storage for channel-pruned key caches: only kept entries plus recovery metadata."""
