"""Speculative decoding: proposers of draft tokens (verification lives in `tokenwise.sampling.rejection`)."""
