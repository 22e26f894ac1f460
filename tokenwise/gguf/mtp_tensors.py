"""The MTP head of a Qwen3.5 / Qwen3-Next GGUF file, under the checkpoint directory's `mtp.*` names.

llama.cpp's converter (unless run with `--no-mtp`) writes the head as blocks after the decoder:
`{arch}.block_count` counts them and `{arch}.nextn_predict_layers` says how many there are. The
head's decoder layer (`mtp.layers.0.*` in the checkpoint) becomes block `L` (`L`: the decoder's
layer count) under the ordinary per-layer names (`blk.L.attn_q`, `blk.L.ffn_gate_exps`, ...),
and its four own tensors become that block's `nextn.*` tensors:

    mtp.fc                     -> blk.L.nextn.eh_proj
    mtp.pre_fc_norm_embedding  -> blk.L.nextn.enorm
    mtp.pre_fc_norm_hidden     -> blk.L.nextn.hnorm
    mtp.norm                   -> blk.L.nextn.shared_head_norm

Every norm among them is stored plus one, as the decoder's are, and undone the same way
(`gdn_tensors`). The head shares the target's embedding and LM head, so no other tensor is
read. Only the first MTP block is read: the head tokenwise runs has one layer, as the
published checkpoints do.

Why names are translated rather than looked up in gguf-py's map: the `gguf` package installed
beside tokenwise lists no `nextn` tensors for these architectures, and its per-layer names only
know the `model.layers.N.` spelling, so the head's names are mapped through block `L`'s.
"""

from __future__ import annotations

from typing import Any

from tokenwise.gguf.hybrid_config import decoder_layers

MTP_PREFIX = "mtp."
_LAYER = f"{MTP_PREFIX}layers.0."
# The head's own tensors (relative to `mtp.`) -> their names in block L (relative to it).
_NEXTN = {
    "fc": "nextn.eh_proj",
    "pre_fc_norm_embedding": "nextn.enorm",
    "pre_fc_norm_hidden": "nextn.hnorm",
    "norm": "nextn.shared_head_norm",
}


def nextn_layers(metadata: dict[str, Any], arch: str) -> int:
    """How many MTP blocks the file holds after the decoder (0: converted with `--no-mtp`)."""
    return int(metadata.get(f"{arch}.nextn_predict_layers") or 0)


def mtp_block(metadata: dict[str, Any], arch: str) -> str:
    """The name prefix of the first MTP block's tensors (`blk.L.`)."""
    return f"blk.{decoder_layers(metadata, arch)}."


def head_names_as_block(expected_names: list[str], first: int) -> list[str]:
    """The head's decoder-layer names (`mtp.layers.0.X`) as block `first`'s HF names
    (`model.layers.{first}.X`), the spelling gguf-py's name map knows."""
    return [
        f"model.layers.{first}.{name[len(_LAYER) :]}"
        for name in expected_names
        if name.startswith(_LAYER)
    ]


def mtp_tensor_names(block_mapping: dict[str, str], first: int) -> dict[str, str]:
    """`{GGUF name: mtp.* name}`: the name map's answers for block `first` (`block_mapping`,
    HF names `model.layers.{first}.X`, a stacked expert's with `{}`) moved back under
    `mtp.layers.0.`, and the four `nextn` tensors."""
    block = f"model.layers.{first}."
    mapping = {
        gguf_name: _LAYER + hf_name[len(block) :]
        for gguf_name, hf_name in block_mapping.items()
        if hf_name.startswith(block)
    }
    for own, nextn in _NEXTN.items():
        mapping[f"blk.{first}.{nextn}.weight"] = f"{MTP_PREFIX}{own}.weight"
    return mapping


__all__ = [
    "MTP_PREFIX",
    "head_names_as_block",
    "mtp_block",
    "mtp_tensor_names",
    "nextn_layers",
]
