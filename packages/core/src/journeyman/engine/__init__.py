from journeyman.engine.base import Engine, Sample, SamplingParams

__all__ = ["Engine", "Sample", "SamplingParams"]
