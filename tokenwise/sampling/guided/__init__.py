"""Guided decoding (structured outputs) with xgrammar: the spec (`params`), its parse
(`grammar`), its compile (`compiler`), a request's matcher (`state`) and the logits mask
(`bitmask`).

Only the spec is imported here: `SamplingParams` carries it, and code that merely builds
sampling parameters (the HTTP front end, a data-parallel client) should not load xgrammar.
"""

from tokenwise.sampling.guided.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams"]
