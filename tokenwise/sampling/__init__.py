"""Sampling: per-request parameters, their batched tensor form, and the sampler."""

from tokenwise.sampling.metadata import SamplingMetadata, make_generator
from tokenwise.sampling.params import SamplingParams, SamplingType
from tokenwise.sampling.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "SamplingType",
    "make_generator",
]
