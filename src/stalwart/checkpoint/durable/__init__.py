"""The durable engine: plan ─► persist ─► commit ─► restore/reshard ─► retention/GC.

A checkpoint on a store (local disk, fsspec) is a manifest plus pack files; see
``docs/format.md``. :class:`~stalwart.checkpoint.durable.checkpointer.Checkpointer` is the
entry point; ``async_save`` is its background half.
"""
