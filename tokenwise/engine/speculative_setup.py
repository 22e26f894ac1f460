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


def make_drafter(
    config: EngineConfig,
    kind_name: str,
    runner: Any,
    num_blocks: int,
    block_manager: Any,
) -> Drafter | None:
    """The `Drafter` for `config.speculative` (None when it is not set); a model kind other
    than "generate" is refused, naming `speculative_config`. `block_manager` is only read
    when speculation is on (under pipeline parallelism it has no single block table)."""
    spec = config.speculative
    if spec is None:
        return None
    if kind_name != "generate":
        raise ValueError(
            "speculative_config applies to decoder-only generation models; this "
            f"model's kind is {kind_name!r}"
        )
    draft_model: DraftModelProposer | None = None
    if spec.method == "draft_model":
        # Its own weights and KV cache, addressed by the target's block ids.
        draft_model = DraftModelProposer(config, num_blocks, runner.device)
    elif spec.method in ("eagle", "eagle3", "mtp"):
        # The same, plus the target's hidden states, which the runner now captures.
        eagle = EagleProposer(config, num_blocks, runner.model, runner.device)
        runner.hidden_capture = TargetHiddenCapture(runner.model, eagle.aux_layers)
        draft_model = eagle
    return Drafter(spec, config.model.max_model_len, draft_model, block_manager.get_block_table)
