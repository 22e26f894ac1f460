"""BERT-family embedding models against Hugging Face: `LLM(task="embed").embed` equals HF's
last hidden states pooled by hand (CLS, attention-mask-aware MEAN, LAST), within 1e-4 in fp32.

References are computed here from HF's `BertModel` / `XLMRobertaModel` on a padded batch, with
pooling written independently of `tokenwise.pooling`; the tiny checkpoints have perturbed
norms and biases (tests/tiny_checkpoints.py), so a parameter that is not loaded shows.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.config import PoolerConfig
from tokenwise.entrypoints.llm import LLM
from tokenwise.pooling.params import PoolingParams

TEXTS = [
    "Hello world",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the tree.",
    "a",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "import os",
]
ATOL = 1e-4


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bert"), "BertModel")


def hf_embeddings(model_dir: str, texts: list[str], pooling: str, normalize: bool, arch: str):
    """HF's hidden states of a padded batch, pooled over each text's real tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    if arch.endswith("ForMaskedLM"):
        model = model.base_model
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"]
    lengths = mask.sum(1)
    if pooling == "CLS":
        pooled = hidden[:, 0]
    elif pooling == "LAST":
        pooled = hidden[torch.arange(len(texts)), lengths - 1]
    else:
        pooled = (hidden * mask[..., None]).sum(1) / lengths[:, None]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def embed(llm: LLM, prompts, params=None) -> torch.Tensor:
    outs = llm.embed(prompts, params, use_tqdm=False)
    assert all(o.finished and o.error is None for o in outs)
    return torch.tensor([o.outputs.embedding for o in outs])


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, task="embed", dtype="float32", device="cpu", **kwargs)


@pytest.mark.parametrize("pooling", ["CLS", "MEAN", "LAST"])
def test_batched_and_single_embeddings_match_hf(bert_dir: str, pooling: str) -> None:
    llm = make_llm(bert_dir, override_pooler_config=PoolerConfig(pooling, normalize=False))
    engine = llm.llm_engine
    steps = engine.get_stats().num_steps_total
    batched = embed(llm, TEXTS)
    # All five mixed-length prompts were encoded in one forward pass.
    assert engine.get_stats().num_steps_total - steps == 1
    expected = hf_embeddings(bert_dir, TEXTS, pooling, False, "BertModel")
    torch.testing.assert_close(batched, expected, atol=ATOL, rtol=0)
    one_by_one = torch.cat([embed(llm, text) for text in TEXTS])
    torch.testing.assert_close(one_by_one, expected, atol=ATOL, rtol=0)
    # Per-request normalisation overrides the model's setting, in the same batch.
    params = [PoolingParams(normalize=i % 2 == 0) for i in range(len(TEXTS))]
    mixed = embed(llm, TEXTS, params)
    normalized = hf_embeddings(bert_dir, TEXTS, pooling, True, "BertModel")
    for i in range(len(TEXTS)):
        torch.testing.assert_close(
            mixed[i], (normalized if i % 2 == 0 else expected)[i], atol=ATOL, rtol=0
        )


def test_default_is_cls_normalized_and_no_kv_cache_exists(bert_dir: str) -> None:
    llm = make_llm(bert_dir, max_num_seqs=2)  # 5 prompts: three steps, still exact
    got = embed(llm, TEXTS)
    torch.testing.assert_close(
        got, hf_embeddings(bert_dir, TEXTS, "CLS", True, "BertModel"), atol=ATOL, rtol=0
    )
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    engine = llm.llm_engine
    runner = engine.runner
    assert runner.kv_caches == {} and runner.num_blocks == 0
    assert runner.attn_layers and all(
        not layer.needs_kv_cache for layer in runner.attn_layers.values()
    )
    assert all(layer.kv_cache[0].numel() == 0 for layer in runner.attn_layers.values())
    stats = engine.get_stats()
    assert stats.num_total_blocks == 0 and stats.kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_token_ids_and_text_give_the_same_embedding(bert_dir: str) -> None:
    llm = make_llm(bert_dir)
    ids = llm.get_tokenizer()(TEXTS[1])["input_ids"]
    assert (
        ids[0] == llm.get_tokenizer().cls_token_id and ids[-1] == llm.get_tokenizer().sep_token_id
    )
    outs = llm.embed([TEXTS[1], {"prompt_token_ids": ids}, ids], use_tqdm=False)
    assert outs[0].prompt_token_ids == ids  # the engine adds [CLS] ... [SEP] like HF
    assert outs[0].outputs.embedding == outs[1].outputs.embedding == outs[2].outputs.embedding


def _write_sentence_transformers(model_dir: str, mode: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(model_dir, "1_Pooling"), exist_ok=True)
    modes = {
        k: False
        for k in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    }
    modes[mode] = True
    config = {"word_embedding_dimension": 64, **{f"pooling_mode_{k}": v for k, v in modes.items()}}
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump(config, f)


def test_sentence_transformers_config_is_honoured(tmp_path) -> None:
    model_dir = build_tiny_checkpoint(tmp_path, "BertModel")
    _write_sentence_transformers(model_dir, "mean_tokens", normalize=True)
    torch.testing.assert_close(
        embed(make_llm(model_dir), TEXTS),
        hf_embeddings(model_dir, TEXTS, "MEAN", True, "BertModel"),
        atol=ATOL,
        rtol=0,
    )
    _write_sentence_transformers(model_dir, "lasttoken", normalize=False)
    torch.testing.assert_close(
        embed(make_llm(model_dir), TEXTS),
        hf_embeddings(model_dir, TEXTS, "LAST", False, "BertModel"),
        atol=ATOL,
        rtol=0,
    )
    # The caller's override wins over the files, field by field.
    llm = make_llm(model_dir, override_pooler_config=PoolerConfig(pooling_type="CLS"))
    assert llm.engine_config.model.pooler_config == PoolerConfig("CLS", False)
    _write_sentence_transformers(model_dir, "max_tokens", normalize=False)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        make_llm(model_dir)


@pytest.mark.parametrize("arch", ["BertForMaskedLM", "XLMRobertaModel"])
def test_other_checkpoints_match_hf(tmp_path, arch: str) -> None:
    model_dir = build_tiny_checkpoint(tmp_path, arch)
    llm = make_llm(model_dir, override_pooler_config=PoolerConfig("MEAN", False))
    torch.testing.assert_close(
        embed(llm, TEXTS), hf_embeddings(model_dir, TEXTS, "MEAN", False, arch), atol=ATOL, rtol=0
    )
    if arch == "XLMRobertaModel":  # 514 position rows, of which the first 1 + padding_idx unused
        assert llm.engine_config.model.max_model_len == 514 - 1


def test_model_without_forward_context_is_bidirectional(bert_dir: str) -> None:
    """Used as a plain module (no engine, no forward context) one sequence still equals HF."""
    llm = make_llm(bert_dir)
    ids = llm.get_tokenizer()(TEXTS[1])["input_ids"]
    with torch.no_grad():
        hidden = llm.llm_engine.runner.model(torch.tensor(ids), torch.arange(len(ids)))
    hf = transformers.BertModel.from_pretrained(bert_dir).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(hidden, expected, atol=ATOL, rtol=0)


def test_task_mismatches_and_limits_are_clear_errors(bert_dir: str, tmp_path) -> None:
    with pytest.raises(ValueError, match="task='embed'"):
        LLM(bert_dir, dtype="float32", device="cpu")  # task defaults to "generate"
    llm = LLM(
        bert_dir,
        task="auto",
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    assert llm.engine_config.model.task == "embed"
    with pytest.raises(ValueError, match="LLM.embed"):
        llm.generate("Hello")
    long_text = " ".join(["cat"] * 20)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        llm.embed(["Hello", long_text], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)
    # Nothing was left queued, and the engine serves the next request.
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(embed(llm, ["Hello", "world"])) == 2
    # An aborted request ends with an empty embedding, explicitly.
    engine = llm.llm_engine
    engine.add_request("x", "Hello")
    engine.abort_request("x")
    (out,) = engine.step()
    assert (
        out.request_id == "x" and out.finished and out.outputs.embedding == [] and out.error is None
    )
    generative = LLM(
        build_tiny_checkpoint(tmp_path), dtype="float32", device="cpu", kv_cache_memory=4 << 20
    )
    with pytest.raises(ValueError, match="needs an embedding model"):
        generative.embed("Hello")
    with pytest.raises(ValueError, match="task='embed' is supported for encoder-only"):
        LLM(build_tiny_checkpoint(tmp_path), task="embed", dtype="float32", device="cpu")


def test_failed_forward_fails_only_its_requests(bert_dir: str, monkeypatch) -> None:
    llm = make_llm(bert_dir)
    runner = llm.llm_engine.runner
    real = runner._run_eager
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_run_eager", fail_once)
    failed = llm.embed(TEXTS[:2], use_tqdm=False)
    assert all(o.finished and "simulated out of memory" in o.error for o in failed)
    assert all(o.outputs.embedding == [] for o in failed)
    torch.testing.assert_close(
        embed(llm, TEXTS[:2]),
        hf_embeddings(bert_dir, TEXTS[:2], "CLS", True, "BertModel"),
        atol=ATOL,
        rtol=0,
    )
    assert llm.llm_engine.get_stats().finished_reasons == {"error": 2, "stop": 2}
