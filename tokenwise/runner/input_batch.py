"""The runner's persistent input batch: buffers allocated once, rows updated incrementally.

Each running request owns a row holding all of its token ids and a mirror of its block tables
(one per KV-cache group; the block manager owns the tables, and each step's
`ScheduledRequest` says how they changed). A step only writes what changed: the rows of new or
resumed requests, the tokens sampled since the last step, the blocks the scheduler reports as
new, and a shorter length where a table was cut back (a rollback). The flat per-step inputs
(token ids, positions, slot mapping, sequence lengths, block tables) are then gathered with a
few vectorised
NumPy operations into pinned host buffers and moved to the device with one non-blocking copy
each. On CPU the device twin is the host buffer itself: no copy at all. Query and sequence
start locations and context lengths are not gathered: no backend reads them per step, and
`AttentionMetadata` derives them from the host lengths if something asks.

Before this, every step rebuilt those inputs as Python lists and turned them into about eight
fresh tensors per attention spec (`benchmarks/input_prep_bench.py` times a step against an
earlier revision).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokenwise.attention.utils import PAD_SLOT_ID
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.request_states import CachedRequestState, state_mismatch


class CpuGpuBuffer:
    """A host buffer (pinned when the device is a GPU) and its device twin."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        # Inference tensors, like everything `execute_model` makes under inference_mode: a
        # compiled model guards on the dispatch keys, and normal tensors would recompile it.
        with torch.inference_mode():
            self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.device = (
                self.cpu if device.type == "cpu" else torch.zeros_like(self.cpu, device=device)
            )
        self.np = self.cpu.numpy()

    def copy_to_device(self, n: int, start: int = 0, width: int | None = None) -> torch.Tensor:
        """Rows `start:n` (first `width` columns) on the device; one non-blocking copy, or
        none on CPU. Returns the device view of rows `:n`."""
        part = (slice(start, n),) if width is None else (slice(start, n), slice(0, width))
        if self.device is not self.cpu:
            self.device[part].copy_(self.cpu[part], non_blocking=True)
        return self.device[:n] if width is None else self.device[:n, :width]


@dataclass
class StepInputs:
    """One step's flat inputs: device views of the batch buffers, plus host copies."""

    num_reqs: int
    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor  # [num_reqs, max_blocks of this step]
    rows: np.ndarray  # the batch row of each scheduled request, in step order (real ones)
    query_lens_np: np.ndarray
    context_lens_np: np.ndarray
    # Flat index of each sampling request's last token (and, before it, of the tokens whose
    # logits verify its drafts: k + 1 rows for a request with k drafts).
    logits_indices: list[int]
    sampled: list[ScheduledRequest]
    # Every real request of the step, in step order (a TP worker's copy has none).
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # The runner's state of each request of `scheduled` and of `sampled` (same orders).
    states: list[CachedRequestState] = field(default_factory=list)
    sampled_states: list[CachedRequestState] = field(default_factory=list)
    # The slot mapping of every attention KV-cache group, group 0's (`slot_mapping`) first;
    # empty with one group. Each group keeps the same tokens in blocks of its own.
    group_slot_mappings: tuple[torch.Tensor, ...] = ()


class InputBatch:
    """Rows for up to `max_num_reqs` requests; flat buffers for `max_num_tokens` tokens."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        """`num_groups`: the model's self-attention KV-cache groups (each has a table per
        request and a slot mapping per step; a cross-attention group is added later)."""
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        # Per-request rows (host only: the runner gathers from them).
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.row_block_tables = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        # How much of each row is written (plain lists: NumPy scalar access is slow per row).
        self.num_tokens = [0] * max_num_reqs
        self.num_blocks = [0] * max_num_reqs
        # The block-table mirror of every KV-cache group; group 0 is the one above, which the
        # flat inputs are gathered from. Other self-attention groups get a slot mapping each.
        self.num_self_groups = max(1, num_groups)
        self.group_tables = [self.row_block_tables] + [
            np.zeros_like(self.row_block_tables) for _ in range(self.num_self_groups - 1)
        ]
        self.group_num_blocks = [self.num_blocks] + [
            [0] * max_num_reqs for _ in range(self.num_self_groups - 1)
        ]
        self.req_index: dict[str, int] = {}
        # The runner's state of the request in each row (looked up by id once, at its row).
        self.row_states: list[CachedRequestState | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Flat per-step buffers, host and device.
        self.input_ids = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.group_slot_mapping = [self.slot_mapping] + [
            CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
            for _ in range(self.num_self_groups - 1)
        ]
        self.seq_lens = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)
        # Fixed width, so a captured graph reads the same address and stride every step; a
        # step copies only its [num_reqs, width] corner.
        self.block_tables = CpuGpuBuffer(
            max_num_reqs, self.max_blocks, dtype=torch.int32, device=device
        )

    # ---- rows -----------------------------------------------------------------------------

    def add_kv_cache_group(self, max_blocks: int) -> int:
        """Mirror one more KV-cache group (cross-attention), up to `max_blocks` per request.

        Returns the group's index, which must match the block manager's for that group.
        """
        if max_blocks < 1:
            raise ValueError(f"a KV-cache group needs max_blocks >= 1, got {max_blocks}")
        self.group_tables.append(np.zeros((self.max_num_reqs, max_blocks), dtype=np.int32))
        self.group_num_blocks.append([0] * self.max_num_reqs)
        return len(self.group_tables) - 1

    def block_ids(self, row: int, group: int) -> list[int]:
        """The mirrored table of the request in `row` for `group`."""
        return self.group_tables[group][row, : self.group_num_blocks[group][row]].tolist()

    def remove_requests(self, request_ids: list[str]) -> None:
        """Free the rows of finished or preempted requests (unknown ids are ignored)."""
        for rid in request_ids:
            row = self.req_index.pop(rid, None)
            if row is not None:
                self._free_rows.append(row)
                self.row_states[row] = None

    def _new_row(self, request_id: str) -> int:
        """A free row for a request new to the batch (or back after a preemption)."""
        if not self._free_rows:
            raise RuntimeError(
                f"input batch has no free row for request {request_id} "
                f"(max_num_reqs={self.max_num_reqs}); finished requests were not removed"
            )
        row = self._free_rows.pop()
        self.req_index[request_id] = row
        self.num_tokens[row] = 0
        for counts in self.group_num_blocks:
            counts[row] = 0
        return row

    def _sync_blocks(self, row: int, item: ScheduledRequest) -> None:
        """Mirror the step's block deltas into the row, group by group."""
        for group, num_blocks in enumerate(item.num_blocks):
            new = item.new_block_ids[group]
            start = num_blocks - len(new)
            if start > self.group_num_blocks[group][row]:
                raise RuntimeError(
                    f"request {item.req_id}: KV-cache group {group} mirrors "
                    f"{self.group_num_blocks[group][row]} blocks, but the step's new blocks "
                    f"start at block {start}; a scheduled step was not seen by the runner"
                )
            if new:  # a window's dropped entries (NULL_BLOCK, -1, only ever leading a list
                # of new blocks: a hit's) are never read: block 0 stands in for them
                self.group_tables[group][row, start:num_blocks] = (
                    new if new[0] >= 0 else np.maximum(new, 0)
                )
            # Shorter than before after a rollback: the tail is simply no longer read.
            self.group_num_blocks[group][row] = num_blocks

    # ---- one step -------------------------------------------------------------------------

    def prepare(
        self, ordered: list[ScheduledRequest], by_id: Mapping[str, CachedRequestState]
    ) -> StepInputs:
        """Gather the step's flat inputs for `ordered` (prefills first) and move them;
        `by_id` holds the runner's state of each request (its tokens), which must have the
        token count the scheduler's entry says."""
        n = len(ordered)
        row_list, q_list, ctx_list, sample_at = [], [], [], []
        num_spec = 0
        # Each request's row brought up to date, only where it changed. This loop runs for
        # every request of every step, so it is written for as little Python as possible.
        req_index, have_tokens, have_blocks = self.req_index, self.num_tokens, self.num_blocks
        row_states = self.row_states
        states: list[CachedRequestState] = []
        for i, item in enumerate(ordered):
            rid = item.req_id
            row = req_index.get(rid)
            if row is None:
                state = by_id.get(rid)
                if state is None:
                    raise state_mismatch(item, None)
                row = self._new_row(rid)
                row_states[row] = state
            else:
                state = row_states[row]
            tokens = state.all_token_ids
            total, have = len(tokens), have_tokens[row]
            if total != item.num_tokens:
                raise state_mismatch(item, state)
            states.append(state)
            if total > have:
                self.token_ids[row, have:total] = tokens[have:total]
                have_tokens[row] = total
            counts = item.num_blocks
            if counts and (
                len(counts) > 1 or item.new_block_ids[0] or counts[0] != have_blocks[row]
            ):
                self._sync_blocks(row, item)
            spec = item.spec_token_ids
            if spec:  # drafts follow the known tokens; the next step's real tokens overwrite them
                self.token_ids[row, total : total + len(spec)] = spec
                total += len(spec)
                num_spec += len(spec)
            row_list.append(row)
            computed, new = item.num_computed_tokens, item.num_new_tokens
            q_list.append(new)
            ctx_list.append(computed)
            if computed + new == total:
                sample_at.append(i)
        rows = np.array(row_list, dtype=np.int64)
        query_lens = np.array(q_list, dtype=np.int64)
        context_lens = np.array(ctx_list, dtype=np.int64)
        cu = np.cumsum(query_lens)
        num_tokens = int(cu[-1]) if n else 0
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"step has {num_tokens} tokens, more than the input batch holds "
                f"({self.max_num_tokens})"
            )
        owner = np.repeat(np.arange(n), query_lens)
        positions = np.arange(num_tokens) - np.repeat(cu - query_lens, query_lens)
        positions += context_lens[owner]
        token_rows = rows[owner]
        self.input_ids.np[:num_tokens] = self.token_ids[token_rows, positions]
        self.positions.np[:num_tokens] = positions
        bs = self.block_size
        if self.num_self_groups == 1:
            blocks = self.row_block_tables[token_rows, positions // bs]
            self.slot_mapping.np[:num_tokens] = blocks * bs + positions % bs
        else:  # each group keeps the tokens in blocks of its own
            block_index, offset = positions // bs, positions % bs
            for group, slots in enumerate(self.group_slot_mapping):
                blocks = self.group_tables[group][token_rows, block_index]
                slots.np[:num_tokens] = blocks * bs + offset
        slot_mapping = self.slot_mapping.copy_to_device(num_tokens)
        seq_lens = context_lens + query_lens
        self.seq_lens.np[:n] = seq_lens
        width = int(-(-seq_lens.max() // self.block_size)) if n else 0
        # Columns past a sequence's last block are zero, never a stale block id.
        used = np.arange(width)[None, :] < -(-seq_lens[:, None] // self.block_size)
        np.multiply(self.row_block_tables[rows, :width], used, out=self.block_tables.np[:n, :width])
        # Each completes its sequence: it samples (every request, in a decode step).
        every = len(sample_at) == n
        sampled = list(ordered) if every else [ordered[i] for i in sample_at]
        sampled_states = states if every else [states[i] for i in sample_at]
        if num_spec:  # a request verifying k drafts needs the logits of its last k + 1 tokens
            logits_indices = [
                j
                for i in sample_at
                for j in range(int(cu[i]) - 1 - len(ordered[i].spec_token_ids), int(cu[i]))
            ]
        else:
            logits_indices = (cu[sample_at] - 1).tolist()
        return StepInputs(
            num_reqs=n,
            num_tokens=num_tokens,
            input_ids=self.input_ids.copy_to_device(num_tokens),
            positions=self.positions.copy_to_device(num_tokens),
            slot_mapping=slot_mapping,
            seq_lens=self.seq_lens.copy_to_device(n),
            block_tables=self.block_tables.copy_to_device(n, width=width),
            rows=rows,
            query_lens_np=query_lens,
            context_lens_np=context_lens,
            logits_indices=logits_indices,
            sampled=sampled,
            scheduled=list(ordered),
            states=states,
            sampled_states=sampled_states,
            group_slot_mappings=self._group_slots(slot_mapping, num_tokens),
        )

    def _group_slots(self, slot_mapping: torch.Tensor, n: int, start: int = 0) -> tuple:
        """Every group's slot mapping on the device (none beside `slot_mapping` for one)."""
        if self.num_self_groups == 1:
            return ()
        rest = (slots.copy_to_device(n, start=start) for slots in self.group_slot_mapping[1:])
        return (slot_mapping, *rest)

    def pad(self, step: StepInputs, num_tokens: int) -> StepInputs:
        """`step` grown to `num_tokens` tokens with one-token decode rows, for a graph.

        Padding rows write their K/V to PAD_SLOT_ID (the backend's trash block), have length 1
        and read block 0: they never touch a block the block manager hands out. They are written
        into the tails of the same buffers, so the step's real part is not copied again.
        """
        pad = num_tokens - step.num_tokens
        if pad < 0:
            raise ValueError(f"cannot pad a step of {step.num_tokens} tokens to {num_tokens}")
        if pad == 0:
            return step
        n, t = step.num_reqs, step.num_tokens
        if n + pad > self.max_num_reqs or num_tokens > self.max_num_tokens:
            raise ValueError(f"cannot pad a step of {n} sequences to {num_tokens} tokens")
        self.input_ids.np[t:num_tokens] = 0
        self.positions.np[t:num_tokens] = 0
        for slots in self.group_slot_mapping:
            slots.np[t:num_tokens] = PAD_SLOT_ID
        self.seq_lens.np[n : n + pad] = 1
        width = step.block_tables.shape[1] or 1
        self.block_tables.np[n : n + pad, :width] = 0
        return replace(
            step,
            num_reqs=n + pad,
            num_tokens=num_tokens,
            input_ids=self.input_ids.copy_to_device(num_tokens, start=t),
            positions=self.positions.copy_to_device(num_tokens, start=t),
            slot_mapping=(slot_mapping := self.slot_mapping.copy_to_device(num_tokens, start=t)),
            group_slot_mappings=self._group_slots(slot_mapping, num_tokens, start=t),
            seq_lens=self.seq_lens.copy_to_device(n + pad, start=n),
            block_tables=self.block_tables.copy_to_device(n + pad, start=n, width=width),
            query_lens_np=np.concatenate([step.query_lens_np, np.ones(pad, dtype=np.int64)]),
            context_lens_np=np.concatenate([step.context_lens_np, np.zeros(pad, dtype=np.int64)]),
        )

    def group_block_tables(self, step: StepInputs, group: int) -> torch.Tensor:
        """`step.block_tables` for another full-attention group: its rows, zero past each
        sequence's last block (padding rows read block 0)."""
        if group == 0:
            return step.block_tables
        return self.windowed_block_tables(step, None, group)[0]

    def windowed_block_tables(
        self, step: StepInputs, sliding_window: int | None, group: int = 0
    ) -> tuple[torch.Tensor, list[int]]:
        """Block tables of `group` trimmed to what a sliding window can see, and each row's
        first block (no window: untrimmed, every first block 0).

        The earliest query of a sequence (position `context_len`) sees keys after
        `context_len - window`, so blocks before that one are never read this step (and may
        already be freed: the block manager drops exactly those).
        """
        if sliding_window is None:
            first = np.zeros_like(step.context_lens_np)
        else:
            first = np.maximum(step.context_lens_np - sliding_window + 1, 0) // self.block_size
        seq_lens = step.context_lens_np + step.query_lens_np
        last = -(-seq_lens // self.block_size)
        width = int((last - first).max()) if step.num_reqs else 0
        cols = first[:, None] + np.arange(width)[None, :]
        real = len(step.rows)  # padding rows (beyond the real ones) read block 0
        valid = (cols < last[:, None]) & (np.arange(step.num_reqs) < real)[:, None]
        rows = np.concatenate([step.rows, np.zeros(step.num_reqs - real, dtype=np.int64)])
        tables = self.group_tables[group]
        gathered = tables[rows[:, None], np.minimum(cols, self.max_blocks - 1)]
        table = torch.from_numpy(np.where(valid, gathered, 0).astype(np.int32))
        return table.to(self.device, non_blocking=True), first.tolist()


__all__ = ["CpuGpuBuffer", "InputBatch", "StepInputs"]
