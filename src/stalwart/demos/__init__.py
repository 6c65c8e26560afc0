"""Demo code for ``stalwart demo``: one module per section. Nothing in the library imports it."""
