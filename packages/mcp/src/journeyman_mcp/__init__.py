"""Journeyman adapter: mcp."""

__all__: list[str] = []
