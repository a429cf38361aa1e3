from .base import Engine, Sample, SamplingParams

__all__ = ["Engine", "Sample", "SamplingParams"]
