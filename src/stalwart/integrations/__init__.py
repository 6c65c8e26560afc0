"""Adapters that plug stalwart into training frameworks (one module per framework)."""
