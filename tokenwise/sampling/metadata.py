"""Batched, tensorised view of the sampling parameters for one engine step.

The sampler runs once per step over every row that needs a token, so the
per-request dataclasses are flattened here into one tensor per knob. Knobs that
no row uses become ``None`` so the sampler can skip that stage entirely; that is
what keeps the common "all greedy" or "plain sampling" batches cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenwise.sampling.params import _SAMPLING_EPS, SamplingParams, SamplingType

# Stands in for "no top-k" when the vocabulary size is unknown; any k at or
# beyond the vocabulary size is treated as off by the sampler.
_NO_TOP_K = 2**31 - 1


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Create the one generator a seeded request keeps for its whole life.

    Reusing it every step (rather than re-seeding) is what makes a seeded
    request's tokens independent of whatever else shares its batch while still
    drawing fresh noise at each step.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for B rows, already on the target device."""

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_token_ids: list[list[int]] = field(default_factory=list)
    prompt_token_ids: list[list[int]] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_token_ids: list[list[int]] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        vocab_size: int | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Flatten per-request params into per-row tensors (one ``torch.tensor`` each)."""
        num_rows = len(params)
        if len(generators) != num_rows:
            raise ValueError(f"got {len(generators)} generators for {num_rows} rows")
        for name, lists in (
            ("output_token_ids", output_token_ids),
            ("prompt_token_ids", prompt_token_ids),
        ):
            if lists is not None and len(lists) != num_rows:
                raise ValueError(f"got {len(lists)} {name} lists for {num_rows} rows")

        types = [p.sampling_type for p in params]
        greedy = [t == SamplingType.GREEDY for t in types]
        # Greedy rows take the argmax, but they still flow through the random
        # pipeline in mixed batches, so give them a harmless temperature.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]

        gens: dict[int, torch.Generator] = {}
        for i, (t, gen) in enumerate(zip(types, generators, strict=True)):
            if t != SamplingType.RANDOM_SEED:
                continue
            if gen is None:
                raise ValueError(
                    f"row {i} has seed={params[i].seed} but no generator; create one with "
                    "make_generator(seed) once per request and pass it every step"
                )
            gens[i] = gen

        no_top_k = _NO_TOP_K if vocab_size is None else vocab_size
        top_k = None
        if any(p.top_k > 0 for p in params):
            top_k = [min(p.top_k, no_top_k) if p.top_k > 0 else no_top_k for p in params]
        top_p = [p.top_p for p in params] if any(p.top_p < 1.0 for p in params) else None
        min_p = [p.min_p for p in params] if any(p.min_p > _SAMPLING_EPS for p in params) else None

        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        requested = [p.logprobs for p in params if p.logprobs is not None]

        def floats(values: list[float] | None) -> torch.Tensor | None:
            if values is None:
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperature=floats(temps),  # type: ignore[arg-type]
            all_greedy=all(greedy),
            all_random=not any(greedy),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=floats(top_p),
            min_p=floats(min_p),
            generators=gens,
            max_num_logprobs=max(requested) if requested else None,
            presence_penalties=floats(presence) if any(v != 0.0 for v in presence) else None,
            frequency_penalties=floats(frequency) if any(v != 0.0 for v in frequency) else None,
            repetition_penalties=floats(repetition) if any(v != 1.0 for v in repetition) else None,
            output_token_ids=output_token_ids
            if output_token_ids is not None
            else [[] for _ in range(num_rows)],
            prompt_token_ids=prompt_token_ids,
        )
