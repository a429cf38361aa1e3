"""Journeyman adapter: agents-sdk."""

__all__: list[str] = []
