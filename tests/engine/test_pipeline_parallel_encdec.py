"""Encoder-decoder models under pipeline parallelism: BART and Whisper as two stages (two
processes; the encoder on stage 0, the decoder layers split), with two batches in flight on
two virtual engines, give transformers' greedy tokens and logprobs (fp32), BART's long decoder
prompts prefilled in chunks and its requests preempted, Whisper's task prompt in two pieces;
every block is free after. Each of three stages builds and loads
exactly its share of the parameters (in-process), and a split of the decoder layers the model
cannot take is refused by name before any stage starts.

One engine per model, each started once: spawned stages are slow to start on small machines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import tokenwise.distributed.pp_state as pp_state
from tests.engine._fixtures import assert_pool_clean
from tests.engine.test_pipeline_parallel import _record_in_flight
from tests.models.test_bart_vs_hf import hf_bart
from tests.models.test_bart_vs_hf import hf_greedy as hf_bart_greedy
from tests.models.test_whisper_vs_hf import CLIPS, RATE, TASK_PROMPT, hf_parts, strip_eos
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.attention.utils import AttentionType
from tokenwise.distributed.pp_state import ENV_LAYER_PARTITION

BART = "BartForConditionalGeneration"
WHISPER = "WhisperForConditionalGeneration"
MAX_TOKENS = 8
ATOL = 1e-4


@contextmanager
def pp2_engine(path: str, **kwargs: Any) -> Iterator[tuple[LLM, list[int]]]:
    """One engine per model (a process holds one pipeline at a time), shut down after."""
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2, **kwargs)
    try:
        yield llm, _record_in_flight(llm)
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()


def _assert_both_virtual_engines_ran(llm: LLM, in_flight: list[int]) -> None:
    """Two batches were in flight, and each virtual engine's slice of the first stage's cross
    caches holds encoder K/V (fails if every request ran on virtual engine 0)."""
    assert max(in_flight) == 2
    runner = llm.llm_engine.runner
    cross = [
        layer
        for layer in runner.cache_layers().values()
        if layer.attn_type is AttentionType.ENCODER_DECODER
    ]
    assert cross
    for layer in cross:
        assert len(layer.kv_cache) == 2 and all(c.abs().sum() > 0 for c in layer.kv_cache)
    assert all(busy > 0 for busy in runner.pipeline.stage_busy_seconds())


def _assert_all_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert_pool_clean(engine)
    for manager in engine.block_manager.managers:  # each virtual engine's, cross tables too
        assert manager.num_cross_tables == 0
        manager.check_invariants()


def _bart_requests() -> list[tuple[list[int], list[int]]]:
    """(encoder ids, decoder prompt): encoders of 1 to 40 tokens, decoder prompts of 1 to 21
    (BART's decoder start token, 0 here, first)."""
    g = torch.Generator().manual_seed(7)
    shapes = [(40, 20), (3, 0), (17, 5), (1, 0), (29, 20), (8, 2), (33, 0), (12, 11)]
    shapes += [(38, 15), (30, 18), (25, 9), (36, 3), (39, 19), (21, 6)]
    return [
        (
            torch.randint(3, 250, (enc,), generator=g).tolist(),
            [0] + torch.randint(3, 250, (dec,), generator=g).tolist(),
        )
        for enc, dec in shapes
    ]


def test_bart_pp2_gives_hf_tokens_and_logprobs(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, BART)
    reqs = _bart_requests()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    prompts = [{"encoder_prompt": e, "decoder_prompt": d} for e, d in reqs]
    # 48 blocks of 4 per virtual engine, the least a 128-token encoder and a 64-token decoder
    # need: the batch does not fit, so requests are preempted (both tables freed) and rerun
    # their encoder on resume. A 48-token budget, which the encoder tokens share: the
    # 40-token encoder with a 21-token decoder prompt must prefill it in pieces.
    settings = {"num_gpu_blocks": 96, "block_size": 4, "max_model_len": 64}
    with pp2_engine(path, max_num_batched_tokens=48, **settings) as (llm, in_flight):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.get_stats().num_preemptions_total > 0
        assert llm.llm_engine.runner.kind_part.num_encoder_runs > len(reqs)
        _assert_both_virtual_engines_ran(llm, in_flight)
        _assert_all_free(llm)
    for (enc, dec), out in zip(reqs, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_bart_greedy(path, enc, dec, MAX_TOKENS)
    # The chunked one, step by step: the later stage's cross-attention reads the K/V it wrote
    # from the first stage's encoder output.
    (enc, dec), completion = reqs[0], outs[0].outputs[0]
    full = dec + list(completion.token_ids)
    with torch.no_grad():
        logits = hf_bart(path).eval()(
            input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([full[:-1]])
        )
    ref = torch.log_softmax(logits.logits[0].float(), dim=-1)[len(dec) - 1 :]
    for step, entry in enumerate(completion.logprobs):
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[step, token].item(), abs=ATOL)


def test_whisper_pp2_gives_hf_transcriptions_and_logprobs(tmp_path: Path) -> None:
    """Three clips with the default decoder prompt against HF `generate`; the fourth with
    Whisper's four task tokens, which a 52-token budget (a 50-token encoder beside them)
    prefills in two pieces, against HF's forward pass on the same tokens."""
    path = build_tiny_checkpoint(tmp_path, WHISPER)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (clip, RATE)}} for clip in CLIPS]
    prompts[3]["prompt"] = TASK_PROMPT
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    settings = {"num_gpu_blocks": 64, "block_size": 8, "max_num_batched_tokens": 52}
    with pp2_engine(path, **settings) as (llm, in_flight):
        outs = llm.generate(prompts, params, use_tqdm=False)
        _assert_both_virtual_engines_ran(llm, in_flight)
        _assert_all_free(llm)
    model, fe = hf_parts(path)
    feats = fe(list(CLIPS), sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        ref_tokens = model.generate(feats[:3], do_sample=False, max_new_tokens=MAX_TOKENS)
    eos = model.config.eos_token_id
    got = [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs[:3]]
    assert got == [strip_eos(row.tolist(), eos) for row in ref_tokens]
    assert len({tuple(g) for g in got}) > 1  # the clips do give different transcriptions
    prompt_ids, completion = outs[3].prompt_token_ids, outs[3].outputs[0]
    assert len(prompt_ids) == 4
    full = prompt_ids + list(completion.token_ids)
    with torch.no_grad():
        logits = model(input_features=feats[3:], decoder_input_ids=torch.tensor([full[:-1]]))
    ref = torch.log_softmax(logits.logits[0].float(), dim=-1)[len(prompt_ids) - 1 :]
    assert list(completion.token_ids) == ref.argmax(-1).tolist()
    for step, entry in enumerate(completion.logprobs):
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[step, token].item(), abs=ATOL)


def _load_stage(path: str, rank: int, size: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Stage `rank` of `size` as its process builds and loads it, without the processes."""
    from tokenwise.entrypoints.llm import build_engine_config
    from tokenwise.loader import load_model

    monkeypatch.setattr(pp_state, "_pp_rank", rank)
    monkeypatch.setattr(pp_state, "_pp_size", size)
    return load_model(build_engine_config(path, dtype="float32"))


# arch -> (a module only the first stage holds, one only the last holds, the head's name when
# the last stage owns a copy of the tied embedding's tensor, that embedding)
STAGE_MODULES = {
    BART: ("model.decoder.embed_positions.", "final_logits_bias", None, None),
    WHISPER: (
        "model.decoder.embed_tokens.",
        "model.decoder.layer_norm.",
        "proj_out.weight",
        "model.decoder.embed_tokens.weight",
    ),
}


@pytest.mark.parametrize("arch", [BART, WHISPER])
def test_each_of_three_stages_loads_exactly_its_share(
    arch: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Three decoder layers over three stages: stage 0 holds the whole encoder, the decoder's
    embeddings and layer 0; stage 1 layer 1 alone (no embedding, no encoder); stage 2 layer 2
    and the head. Together: the one-process model's parameters, with its values."""
    monkeypatch.delenv(ENV_LAYER_PARTITION, raising=False)
    path = build_tiny_checkpoint(tmp_path, arch, encoder_layers=2, decoder_layers=3)
    whole = dict(_load_stage(path, 0, 1, monkeypatch).named_parameters())
    stages = [_load_stage(path, rank, 3, monkeypatch) for rank in range(3)]
    params = [dict(stage.named_parameters()) for stage in stages]
    first_only, last_only, head_copy, embedding = STAGE_MODULES[arch]
    for rank, names in enumerate(params):
        layers = {int(n.split(".")[3]) for n in names if n.startswith("model.decoder.layers.")}
        assert layers == {rank}
        encoder = {n for n in names if n.startswith("model.encoder.")}
        assert bool(encoder) == (rank == 0)
        assert any(n.startswith(first_only) for n in names) == (rank == 0)
        assert any(n.startswith(last_only) for n in names) == (rank == 2)
    assert not any("shared" in n or "embed" in n for n in params[1])
    staged = {**params[0], **params[1], **params[2]}
    assert set(staged) == set(whole) | ({head_copy} if head_copy else set())
    for name, param in whole.items():
        assert torch.equal(staged[name], param), name
    if head_copy is not None:
        assert torch.equal(staged[head_copy], whole[embedding])


@pytest.mark.parametrize(
    ("pp", "partition", "match"),
    [
        (3, None, r"pipeline_parallel_size \(3\) exceeds the model's decoder_layers \(2\)"),
        # Four encoder layers: a split of those (HF's num_hidden_layers) is not the decoder's.
        (2, "3,1", r"TOKENWISE_PP_LAYER_PARTITION='3,1' sums to 4 layers, .*decoder_layers=2"),
    ],
)
def test_a_split_the_decoder_cannot_take_is_refused_naming_it(
    pp: int, partition: str | None, match: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = build_tiny_checkpoint(tmp_path, BART, encoder_layers=4, decoder_layers=2)
    if partition is None:
        monkeypatch.delenv(ENV_LAYER_PARTITION, raising=False)
    else:
        monkeypatch.setenv(ENV_LAYER_PARTITION, partition)
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", pipeline_parallel_size=pp)
    assert not torch.distributed.is_initialized()
