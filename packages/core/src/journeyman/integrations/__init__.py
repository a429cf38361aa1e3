"""Integrations with tools teams already run (each behind its own extra, imported only when used)."""
