"""Journeyman adapter: langgraph."""

__all__: list[str] = []
