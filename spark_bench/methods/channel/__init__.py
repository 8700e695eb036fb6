"""Key-channel pruning methods (and SparK's recovery functions), one per module."""
