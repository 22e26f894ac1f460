"""Sequence classifiers against Hugging Face: `LLM.score` and `LLM.classify` equal HF's
`*ForSequenceClassification` logits through the checkpoint's activation, within 1e-4 in fp32.

Cross-encoders (BERT with token types, XLM-RoBERTa with one type) score (query, document)
pairs as HF reads them: `tokenizer(query, document)` in one sequence. The Qwen3 classifier
reads its last token through causal attention with no KV cache. References come from HF run one
sequence at a time, with sigmoid / softmax written here; the engine batches them in one step.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.pooling.classifier import classifier_activation
from tokenwise.pooling.params import PoolingParams
from tokenwise.sampling.params import SamplingParams

QUERIES = ["what is a cat", "paged attention"]
DOCS = [
    "The cat sat on the mat.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "a",
]
ATOL = 1e-4


def hf_logits(model_dir: str, arch: str, first: str, second: str | None, types: bool = True):
    """HF's logits for one text (or pair), batch of one; `types=False` drops token types."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    typed = types and getattr(model.config, "type_vocab_size", 1) > 1
    enc = tokenizer(first, second, return_tensors="pt", return_token_type_ids=typed)
    with torch.no_grad():
        return model(**enc).logits[0]


def make_llm(tmp_path_factory, arch: str, task: str, **overrides) -> tuple[str, LLM]:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **overrides)
    return path, LLM(path, task=task, dtype="float32", device="cpu", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[str, LLM]:
    return make_llm(tmp_path_factory, "BertForSequenceClassification", "auto", num_labels=1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[str, LLM]:
    return make_llm(tmp_path_factory, "Qwen3ForSequenceClassification", "auto", num_labels=3)


def test_bert_cross_encoder_scores_equal_hf(bert) -> None:
    path, llm = bert
    arch = "BertForSequenceClassification"
    assert llm.engine_config.model.task == "score"  # "auto": one label
    one_to_many = llm.score(QUERIES[0], DOCS, use_tqdm=False)
    pairwise = llm.score(QUERIES + [QUERIES[0]], DOCS, use_tqdm=False)
    for outs, firsts in ((one_to_many, [QUERIES[0]] * 3), (pairwise, QUERIES + [QUERIES[0]])):
        assert len(outs) == 3
        for out, first, doc in zip(outs, firsts, DOCS, strict=True):
            expected = torch.sigmoid(hf_logits(path, arch, first, doc))[0].item()
            assert out.outputs.score == pytest.approx(expected, abs=ATOL)
            assert out.error is None and out.finished
    # Token types reach the model: without them HF scores the first pair differently.
    untyped = torch.sigmoid(hf_logits(path, arch, QUERIES[0], DOCS[0], types=False))[0].item()
    assert abs(untyped - one_to_many[0].outputs.score) > 1e-3
    tokenizer = llm.get_tokenizer()
    assert one_to_many[1].prompt_token_ids == tokenizer(QUERIES[0], DOCS[1])["input_ids"]


def test_xlm_roberta_cross_encoder_scores_equal_hf(tmp_path_factory) -> None:
    arch = "XLMRobertaForSequenceClassification"
    path, llm = make_llm(tmp_path_factory, arch, "score", num_labels=1)
    outs = llm.score(QUERIES[1], DOCS, use_tqdm=False)
    expected = [torch.sigmoid(hf_logits(path, arch, QUERIES[1], d))[0].item() for d in DOCS]
    assert [o.outputs.score for o in outs] == pytest.approx(expected, abs=ATOL)


def test_qwen3_classifier_probs_equal_hf(qwen3) -> None:
    path, llm = qwen3
    assert llm.engine_config.model.task == "classify"  # "auto": three labels
    texts = [*DOCS, "import os"]
    outs = llm.classify(texts, use_tqdm=False)
    for out, text in zip(outs, texts, strict=True):
        expected = torch.softmax(hf_logits(path, "Qwen3ForSequenceClassification", text, None), -1)
        assert out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="LLM.score needs a model loaded with task='score' or "):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="task='classify' and cannot generate text"):
        llm.generate("Hello")


def test_qwen3_classifier_in_two_pipeline_stages_equals_hf(qwen3) -> None:
    """Pipeline parallelism with a pooling model: the last stage sends its hidden states
    back, the driver pools them and runs the score head (two virtual engines, no KV cache)."""
    path, _ = qwen3
    llm = LLM(path, task="classify", dtype="float32", pipeline_parallel_size=2)
    try:
        texts = [*DOCS, "import os"]
        outs = llm.classify(texts, use_tqdm=False)
        for out, text in zip(outs, texts, strict=True):
            logits = hf_logits(path, "Qwen3ForSequenceClassification", text, None)
            want = torch.softmax(logits, -1)
            torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=ATOL, rtol=0)
        assert llm.llm_engine.runner.model.model.end_layer < 2  # a stage's half of the layers
    finally:
        llm.shutdown()


def test_qwen3_reward_model_scores_equal_hf(tmp_path_factory) -> None:
    arch = "Qwen3ForSequenceClassification"
    path, llm = make_llm(tmp_path_factory, arch, "score", num_labels=1)
    outs = llm.score(QUERIES, DOCS[:2], use_tqdm=False)
    for out, first, doc in zip(outs, QUERIES, DOCS[:2], strict=True):
        expected = torch.sigmoid(hf_logits(path, arch, first, doc))[0].item()
        assert out.outputs.score == pytest.approx(expected, abs=ATOL)


def test_embedding_model_scores_by_cosine_similarity(tmp_path_factory) -> None:
    """vLLM's scoring with a bi-encoder: the cosine of the two texts' embeddings (those are
    checked against HF in test_bert_vs_hf.py)."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("bert-embed"), "BertModel")
    llm = LLM(path, task="embed", dtype="float32", device="cpu")
    outs = llm.score(QUERIES[0], DOCS, use_tqdm=False)
    query = torch.tensor(llm.embed(QUERIES[0], use_tqdm=False)[0].outputs.embedding)
    for out, doc in zip(outs, DOCS, strict=True):
        vector = torch.tensor(llm.embed(doc, use_tqdm=False)[0].outputs.embedding)
        expected = (query @ vector / (query.norm() * vector.norm())).item()
        assert out.outputs.score == pytest.approx(expected, abs=1e-5)
        assert len(out.prompt_token_ids) == len(llm.get_tokenizer()(QUERIES[0])["input_ids"]) + len(
            llm.get_tokenizer()(doc)["input_ids"]
        )
    assert len({o.outputs.score for o in outs}) == 3  # the documents differ


def test_bad_input_and_task_mismatches_are_clear_errors(bert, qwen3) -> None:
    _, llm = bert
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(QUERIES, DOCS)
    with pytest.raises(ValueError, match=r"text_2\[1\] is an empty string"):
        llm.score("q", ["a", ""])
    with pytest.raises(ValueError, match="LLM.classify needs a model loaded with task='classify'"):
        llm.classify("a")
    with pytest.raises(ValueError, match="LLM.embed needs an embedding model"):
        llm.embed("a")
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"token_type_ids must hold integers in \[0, 2\)"):
        engine.add_request("t", {"prompt_token_ids": [2, 3], "token_type_ids": [0, 2]})
    with pytest.raises(ValueError, match=r"one integer per prompt token \(2\), got 1"):
        engine.add_request("t", {"prompt_token_ids": [2, 3], "token_type_ids": [0]})
    with pytest.raises(ValueError, match="normalize applies to embeddings"):
        engine.add_request("n", "a", PoolingParams(normalize=True))
    with pytest.raises(ValueError, match="is a scoring model .*use LLM.score"):
        engine.add_request("g", "a", SamplingParams())
    assert not engine.has_unfinished_requests()
    path3 = qwen3[0]
    with pytest.raises(ValueError, match="task='score' needs a classifier with one label"):
        LLM(path3, task="score", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="is a sequence classifier; use task='score'"):
        LLM(path3, task="embed", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="override_pooler_config applies to task='embed'"):
        from tokenwise.config import PoolerConfig

        LLM(path3, task="classify", override_pooler_config=PoolerConfig("MEAN"))


def test_activation_follows_problem_type() -> None:
    config = transformers.BertConfig(num_labels=2)
    assert classifier_activation(config) == "softmax"
    config.problem_type = "multi_label_classification"
    assert classifier_activation(config) == "sigmoid"
    assert classifier_activation(transformers.BertConfig(num_labels=1)) == "sigmoid"
    assert classifier_activation(transformers.BertConfig(problem_type="regression")) == "none"
