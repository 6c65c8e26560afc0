"""Tools over committed checkpoints, on the checkpointer's public read API: verify, diff,
export and import.
"""
