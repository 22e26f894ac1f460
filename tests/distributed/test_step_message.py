"""The typed step message TP workers and pipeline stages receive (`step_message.py`)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from tests._states import states_of
from tokenwise.distributed.step_message import decode_step, encode_step, step_inputs
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.lora.request import LoRARequest
from tokenwise.runner.input_batch import InputBatch
from tokenwise.sampling.params import SamplingParams


def _step() -> tuple:
    batch = InputBatch(4, 64, 128, 16, torch.device("cpu"), num_groups=2)
    reqs = [
        ScheduledRequest(
            Request("a", list(range(20)), SamplingParams()), 20, 0, ([1, 2], [5, 6]), (2, 2)
        ),
        ScheduledRequest(Request("b", list(range(7)), SamplingParams()), 7, 0, ([3], [7]), (1, 1)),
    ]
    step = batch.prepare(reqs, states_of(reqs))
    table1, first1 = batch.windowed_block_tables(step, 8, 1)
    tables = {
        0: (step.block_tables, None, step.slot_mapping),
        1: (table1, first1, step.group_slot_mappings[1]),
    }
    return step, tables


def test_a_step_arrives_as_it_left() -> None:
    step, tables = _step()
    lora = LoRARequest("adapter", 3, "/tmp/adapter")
    data = encode_step(step, tables, [lora, None])
    assert isinstance(data, bytes)
    message = decode_step(data)
    got, got_tables = step_inputs(message, torch.device("cpu"))
    assert message.loras == [lora, None]
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
        assert torch.equal(getattr(got, name), getattr(step, name)), name
    np.testing.assert_array_equal(got.query_lens_np, step.query_lens_np)
    np.testing.assert_array_equal(got.context_lens_np, step.context_lens_np)
    assert got.logits_indices == step.logits_indices and got.num_tokens == 27
    assert set(got_tables) == {0, 1}
    table, first, slots = got_tables[1]
    assert torch.equal(table, tables[1][0]) and first == tables[1][1]
    # Group 1 keeps the same tokens in its own blocks (5, 6 and 7): other slots than group 0's.
    assert torch.equal(slots, tables[1][2]) and not torch.equal(slots, got.slot_mapping)
    assert int(slots[0]) == 5 * 16 and int(got.slot_mapping[0]) == 1 * 16


def test_the_message_owns_its_data() -> None:
    """A pipeline stage may still hold a step when the driver's buffers take the next one."""
    step, tables = _step()
    data = encode_step(step, tables)
    with torch.inference_mode():  # the batch's buffers are inference tensors
        step.input_ids.fill_(-1)
    got, _ = step_inputs(decode_step(data), torch.device("cpu"))
    assert int(got.input_ids.min()) >= 0


def test_a_malformed_message_names_the_field() -> None:
    step, tables = _step()
    message = msgspec.msgpack.decode(encode_step(step, tables))
    message[0] = "four"  # num_reqs
    with pytest.raises(msgspec.ValidationError, match=r"\$\[0\]"):
        decode_step(msgspec.msgpack.encode(message))
