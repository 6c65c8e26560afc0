"""The memory tier: snapshots in host memory, the tmpfs keeper, erasure coding across peers,
tiers and recovery (peers' memory first, then durable tiers).
"""
