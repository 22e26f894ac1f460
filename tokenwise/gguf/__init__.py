"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

A GGUF file carries the model's hyper-parameters and tokenizer as metadata and its tensors
under llama.cpp's names, often block-quantized. This package turns one into what the rest of
the engine already consumes: a transformers config (`hf_config.py`), Hugging Face-named tensors
dequantized to the engine's dtype at load (`weights.py`) and a tokenizer directory with the
file's chat template (`tokenizer.py`). The tensors are dequantized on load: quantized kernels
(keeping Q8_0 / Q4_K blocks packed in memory) are not part of this package yet.

It depends on nothing else in tokenwise, so it sits below the configuration layer.
"""
