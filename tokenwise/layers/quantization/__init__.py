"""Quantization as methods (vLLM's shape): a `QuantizationConfig` per method, looked up by name
in one registry (`registry`), gives each linear and MoE layer its `quant_method`
(`base_config`: `create_weights`, `process_weights_after_loading`, `apply`).

Map: `base_config` (the interfaces), `registry` (name -> config), `unquantized` (the dense
method every layer is built with), `linear_methods` (int8 / int4 weight-only, FP8);
the configs: `weight_only_config` (int8 / int4 on load), `gguf_layers` (GGUF),
`prequantized_config` (GPTQ, AWQ, compressed-tensors), `fp8_config` (FP8); the formats'
readers and weights: `weight_only` (int8 / int4 weights, with the C kernels in
`tokenwise.native.qgemv`), `schemes` (which layers get which format), `prequantized`, `gptq`,
`awq`, `compressed_tensors`, `gguf_kquants`, `fp8`, `fp8_loading`, `tp_slice`,
`act_order_slice`; on CUDA, `gpu_selfcheck`, `gpu_int4`, `gpu_weight_only`. MoE expert
methods live with the MoE layer (`layers.fused_moe.moe_methods`).
"""
