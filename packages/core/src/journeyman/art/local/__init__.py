"""`art.local`: ART's LocalBackend (defined in `art.local.backend`, where ART's examples import it from)."""

from journeyman.art.local.backend import ART_PATH, LocalBackend

__all__ = ["ART_PATH", "LocalBackend"]
