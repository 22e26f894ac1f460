"""The native (C) kernels of CPU decode, each beside the ctypes wrapper that builds and calls it.

`paged_decode` (decode attention), `gemv` (float32 / bf16 linear layers of a few rows), `qgemv`
(int8 / int4 weight-only), `fp8_gemv` (FP8 weights), `fused` (RMSNorm, RoPE, SwiGLU's
activation, embedding rows, argmax) and `graph` (a CPU graph's replay loop). `common.h` is what
the C files share; `build` compiles and loads them (one cache, one fallback rule); `trace` is
the one way every kernel is called, so that a CPU graph can record it.
"""
