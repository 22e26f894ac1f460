"""Quantized linear weights: group-wise int8 / int4 weight-only layers on CPU (`weight_only`,
with the C kernels in `tokenwise.native.qgemv`) and which layers get which format (`schemes`)."""
