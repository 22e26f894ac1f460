"""A vision-language model's part of the runner (LLaVA, Qwen2.5-VL, Gemma 3): image
embeddings (and 3-D positions) on top of the decoder's step.

A step is laid out as for any decoder (prefills first, one flat token stream). What a
multimodal step adds is, for each prompt chunk that covers placeholder tokens of an image, the
image's embedding rows for exactly those tokens: a chunked prefill may start or stop inside
an image, so the chunk takes the slice `[max(computed, offset), min(computed + new, end))` of
the image's rows. The model gets the rows and their indices in the flat stream
(`image_embeds`, `image_token_rows`) and writes them over the placeholders' text embeddings.

Embeddings come from the `EncoderCache`: the vision tower runs once per image (all images a
step misses, in one batch) when a prefill first reaches its placeholders, and the rows stay
there until the request has prefilled past them. A request that hits the prefix cache past an
image never needs it; one preempted and resumed takes it again (recomputing it if no other
request kept it).

A model whose image tokens attend to each other both ways (Gemma 3,
`bidirectional_image_attention`) gets each prefill row's image spans on the step's attention
metadata (`image_spans_by_row`), which every layer's backend reads from the forward context;
a model that names the layers that do (Gemma 4: `bidirectional_image_layers`, its sliding
ones) gets them on those layers' KV-cache groups only.

A model with M-RoPE (Qwen2.5-VL) gets every step's `[3, T]` positions (`mrope_positions`),
filled from the requests' precomputed prompt positions and their deltas into a persistent
buffer beside the 1-D one (`mrope_positions.py`).

Steps with image rows run eagerly on the uncompiled model (their extra inputs have a shape no
graph was captured for); the configuration turns compilation and graphs off for these models
altogether for now, since no graphed path has been tested with them. One rank.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenwise.attention.backends.image_mask import put_image_spans
from tokenwise.compilation.compile import CompiledModel
from tokenwise.engine.kinds.encoder_cache import EncoderCache
from tokenwise.engine.kinds.image_inputs import ImageInput
from tokenwise.engine.kinds.mrope_positions import step_mrope_positions
from tokenwise.engine.step_outputs import ScheduledRequest, SchedulerOutput
from tokenwise.runner.input_batch import CpuGpuBuffer, StepInputs
from tokenwise.runner.kind_part import RunnerKindPart
from tokenwise.runner.request_states import CachedRequestState

# One image's part of a step: (request id, image, first and end prompt position, flat index).
ImageSlice = tuple[str, ImageInput, int, int, int]


def image_slices(
    ordered: list[ScheduledRequest], states: list[CachedRequestState]
) -> list[ImageSlice]:
    """The placeholder tokens each scheduled chunk computes, image by image, in step order."""
    slices: list[ImageSlice] = []
    start = 0
    for item, state in zip(ordered, states, strict=True):
        computed, new = item.num_computed_tokens, item.num_new_tokens
        for image in state.kind_inputs.get("images", ()):
            lo, hi = max(computed, image.offset), min(computed + new, image.end)
            if lo < hi:
                slices.append((item.req_id, image, lo, hi, start + lo - computed))
        start += new
    return slices


def image_spans_by_row(
    ordered: list[ScheduledRequest], states: list[CachedRequestState]
) -> list[list[tuple[int, int]]]:
    """Per prefill row (step order; prefills lead): the images its query tokens touch, as
    `(start, end)` prompt positions. Earlier images need none: their tokens are all cached, and
    the query tokens after an image see it causally anyway."""
    spans: list[list[tuple[int, int]]] = []
    for item, state in zip(ordered, states, strict=True):
        if item.num_new_tokens == 1:  # a decode row (the scheduler never leaves one image
            break  # token alone in a chunk, unless it is the image's last: causal suffices)
        lo = item.num_computed_tokens
        hi = lo + item.num_new_tokens
        images = state.kind_inputs.get("images", ())
        spans.append([(im.offset, im.end) for im in images if im.offset < hi and im.end > lo])
    return spans


class MultiModalRunnerPart(RunnerKindPart):
    def setup(self) -> None:
        runner = self.runner
        if runner.tp_size > 1:
            raise ValueError("vision-language models run on one rank")
        self.encoder_cache = EncoderCache()
        self.num_encoder_runs = 0  # images the vision tower encoded, over the runner's life
        model = runner.model
        self.eager_model = model.model if isinstance(model, CompiledModel) else model
        self.mrope_buffer: CpuGpuBuffer | None = None
        self.bidirectional_images = bool(
            getattr(self.eager_model, "bidirectional_image_attention", False)
        )
        if getattr(self.eager_model, "uses_mrope", False):
            rows = runner.input_batch.max_num_tokens
            self.mrope_buffer = CpuGpuBuffer(rows, 3, dtype=torch.int64, device=runner.device)

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        # Requests that left the batch (finished, aborted, preempted) let go of their images.
        for request_id in scheduler_output.finished_req_ids + scheduler_output.preempted_req_ids:
            self.encoder_cache.release_request(request_id)

    def may_replay_graphs(self, step: StepInputs) -> bool:
        return self.mrope_buffer is None and not image_slices(step.scheduled, step.states)

    def forward_model(self, model_kwargs: dict[str, Any] | None) -> Any:
        return self.eager_model if model_kwargs else self.runner.model

    def model_inputs(self, step: StepInputs, attn_metadata: Any) -> dict[str, Any]:
        inputs = self._image_inputs(step)
        if self.bidirectional_images and attn_metadata:
            spans = image_spans_by_row(step.scheduled, step.states)
            if any(spans):
                layers = getattr(self.eager_model, "bidirectional_image_layers", None)
                put_image_spans(attn_metadata, spans, layers)
        if self.mrope_buffer is not None:
            buffer = self.mrope_buffer
            n = step_mrope_positions(
                buffer.np, self.runner.input_batch.positions.np, step.scheduled, step.states
            ).shape[0]
            inputs["mrope_positions"] = buffer.copy_to_device(n).t()
        return inputs

    def _image_inputs(self, step: StepInputs) -> dict[str, Any]:
        slices = image_slices(step.scheduled, step.states)
        if not slices:
            return {}
        embeds = self._embeddings(slices)
        rows: list[torch.Tensor] = []
        indices: list[torch.Tensor] = []
        for request_id, image, lo, hi, flat in slices:
            key = image.content_hash
            rows.append(embeds[key][lo - image.offset : hi - image.offset])
            indices.append(torch.arange(flat, flat + hi - lo))
            if hi == image.end:  # this chunk reaches the image's end: the request is done
                self.encoder_cache.release(request_id, key)
        return {
            "image_embeds": torch.cat(rows),
            "image_token_rows": torch.cat(indices).to(self.runner.device),
        }

    def _embeddings(self, slices: list[ImageSlice]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings, encoding in one batch those the cache does not hold."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, tuple[ImageInput, list[str]]] = {}
        for request_id, image, *_ in slices:
            key = image.content_hash
            cached = self.encoder_cache.get(request_id, key)
            if cached is not None:
                found[key] = cached
            elif key in missing:  # a second request needs it this step: encoded once
                missing[key][1].append(request_id)
                self.encoder_cache.served_by_pending()
            else:
                missing[key] = (image, [request_id])
        if missing:
            images = [image for image, _ in missing.values()]
            encoded = self.eager_model.embed_image_list(
                [image.pixel_values.to(self.runner.device) for image in images],
                [image.grid_thw for image in images],
            )
            self.num_encoder_runs += len(missing)
            for (key, (_, holders)), embeds in zip(missing.items(), encoded, strict=True):
                for request_id in holders:
                    self.encoder_cache.put(request_id, key, embeds)
                found[key] = embeds
        return found
