"""The runner's own copy of each request (`runner/request_states.py`).

The scheduler sends a request's settings once; the runner records the tokens it samples and
checks the scheduler's count every step, so a step it did not see is an error naming the
request, not wrong tokens; and the state (its seeded generator above all) outlives a
preemption, so a seeded request draws the same tokens whether or not it was preempted.
"""

from __future__ import annotations

import pytest
import torch

from tests._states import states_of
from tests.engine._fixtures import checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.input_batch import InputBatch


def _entry(req: Request) -> ScheduledRequest:
    return ScheduledRequest(req, req.num_tokens, 0, ([0, 1],), (2,))


def test_a_step_the_runner_did_not_see_is_an_error_naming_the_request() -> None:
    batch = InputBatch(4, 64, 64, 16, torch.device("cpu"))
    known = Request("known", list(range(10)), SamplingParams())
    with pytest.raises(RuntimeError, match="request stranger: the runner has no state"):
        batch.prepare([_entry(Request("stranger", [1, 2], SamplingParams()))], {})
    states = states_of([_entry(known)])
    known.append_output_token(7)  # sampled, but never recorded in the runner's copy
    with pytest.raises(RuntimeError, match="holds 10 tokens but the scheduler counts 11"):
        batch.prepare([_entry(known)], states)


def test_a_seeded_request_draws_the_same_tokens_through_a_preemption() -> None:
    prompts = [[(7 * i + j) % 97 + 3 for j in range(30 + 9 * i)] for i in range(4)]
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=24) for i in range(4)]
    roomy = LLM(checkpoint(), dtype="float32", num_gpu_blocks=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    roomy.shutdown()
    # 8 blocks of 16 for four requests of up to 81 tokens: they preempt one another.
    tight = LLM(checkpoint(), dtype="float32", num_gpu_blocks=8, max_model_len=128, max_num_seqs=4)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.get_stats().num_preemptions_total > 0
    assert got == expected
    tight.shutdown()
