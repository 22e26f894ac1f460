"""The engine's speculative decoding at start-up: the proposer `speculative_config` names.

Apart from the engine loop because it is construction only, and the one place that ties the
three sides together: the proposer (`spec_decode`: n-gram lookup, a draft model with its own
KV cache addressed by the target's block ids, or an EAGLE / MTP head that also reads the
target's hidden states, which the runner is then told to capture), the engine's `Drafter`
that asks it for drafts every step, and the runner. The loop itself only calls the `Drafter`.
"""

from __future__ import annotations

from typing import Any

from tokenwise.config import EngineConfig
from tokenwise.engine.drafter import Drafter
from tokenwise.runner.target_hidden import TargetHiddenCapture
from tokenwise.spec_decode.draft_model import DraftModelProposer
from tokenwise.spec_decode.eagle import EagleProposer


def make_proposer(config: EngineConfig, kind_name: str, runner: Any) -> DraftModelProposer | None:
    """The draft model (or EAGLE / MTP head) `config.speculative` names, loaded beside the
    target's runner before KV sizing, which counts its KV group in the same budget
    (`runner.kv_sizer.add_group`); None for n-gram lookup or no speculation. A model kind other
    than "generate" is refused, naming `speculative_config`."""
    spec = config.speculative
    if spec is None:
        return None
    if kind_name != "generate":
        raise ValueError(
            "speculative_config applies to decoder-only generation models; this "
            f"model's kind is {kind_name!r}"
        )
    proposer: DraftModelProposer | None = None
    if spec.method == "draft_model":
        # Its own weights and KV cache, addressed by the target's block ids.
        proposer = DraftModelProposer(config, runner.device)
    elif spec.method in ("eagle", "eagle3", "mtp"):
        # The same, plus the target's hidden states, which the runner now captures.
        eagle = EagleProposer(config, runner.model, runner.device)
        runner.hidden_capture = TargetHiddenCapture(runner.model, eagle.aux_layers)
        proposer = eagle
    if proposer is not None:
        runner.kv_sizer.add_group(proposer.kv_bytes_per_block(), proposer.reserved_kv_bytes())
    return proposer


def make_drafter(
    config: EngineConfig,
    proposer: DraftModelProposer | None,
    num_blocks: int,
    block_manager: Any,
) -> Drafter | None:
    """The `Drafter` for `config.speculative` (None when it is not set), the proposer's
    cache allocated for the agreed `num_blocks`. `block_manager` is only read when
    speculation is on (under pipeline parallelism it has no single block table)."""
    spec = config.speculative
    if spec is None:
        return None
    if proposer is not None:
        proposer.allocate(num_blocks)
    return Drafter(spec, config.model.max_model_len, proposer, block_manager.get_block_table)
