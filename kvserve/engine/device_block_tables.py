"""Block tables that live on the device and change only by the entries that changed.

A decode step of 128 sequences at 4K tokens reads 128 block tables of 256 entries; copying them
from the host every step is most of the step's host-to-device bytes, although a decoding
sequence's table gains one entry every `block_size` tokens and otherwise stays as it is. Here each
request holds a row of one device matrix; a step uploads only the entries its requests' tables
gained since their row was written (vLLM v1 keeps its block tables on the device the same way).

A row is rewritten whole when its request's table no longer starts with what was uploaded
(preempted and allocated again, or its row given to another request meanwhile). Rows are handed
out least recently used first among the requests not in the step; row 0 stays all zeros, the
null block, for padding rows.

Checking that a table still starts with what was uploaded costs a compare of the whole table per
request per step, which grows with the context (BENCHMARKS.md, "The device block tables'
bookkeeping"). The KV cache
manager's tables are append-only for as long as they are the request's: a compaction or a fresh
allocation after preemption gives the request a new list (`KVCacheManager.block_table`). So a
step that passes the very list object uploaded last time needs no compare; any other list is
compared.
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve.transfers import host_to_device


class DeviceBlockTables:
    def __init__(self, num_rows: int, width: int, device: torch.device):
        self.width = width
        self.device = device
        self.table = torch.zeros(num_rows + 1, width, dtype=torch.long, device=device)
        self._free = list(range(num_rows, 0, -1))
        # request id -> (row, the table list last passed, the entries uploaded), least recently used first
        self._held: dict[str, tuple[int, list[int], list[int]]] = {}
        self.entries_uploaded = 0  # entries copied to the device so far (what a test or a profile counts)

    def rows(self, request_ids: list[str], tables: list[list[int]]) -> list[int]:
        """Each request's row in `table`, once the entries its table gained are written there."""
        in_step = set(request_ids)
        writes: list[tuple[int, int, list[int]]] = []  # (row, first column, entries)
        rows = []
        for request_id, blocks in zip(request_ids, tables):
            if len(blocks) > self.width:
                raise ValueError(f"a block table of {len(blocks)} entries is wider than {self.width}")
            held = self._held.pop(request_id, None)
            if held is not None and _extends(blocks, held[1], held[2]):
                row, _, uploaded = held
                if len(blocks) > len(uploaded):
                    writes.append((row, len(uploaded), blocks[len(uploaded):]))
                    uploaded.extend(blocks[len(uploaded):])
            else:
                row = held[0] if held is not None else self._take_row(in_step)
                uploaded = list(blocks)
                writes.append((row, 0, uploaded))
            self._held[request_id] = (row, blocks, uploaded)  # now the most recently used
            rows.append(row)
        self._write(writes)
        return rows

    def _take_row(self, in_step: set[str]) -> int:
        if self._free:
            return self._free.pop()
        victim = next((rid for rid in self._held if rid not in in_step), None)
        if victim is None:
            raise RuntimeError(f"more than {self.table.shape[0] - 1} requests in one step")
        return self._held.pop(victim)[0]

    def _write(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """Every new entry in one host-to-device copy and one indexed write."""
        if not writes:
            return
        rows: list[int] = []
        columns: list[int] = []
        entries: list[int] = []
        for row, first, new in writes:  # plain lists: a decode's one new entry costs no numpy call
            rows += [row] * len(new)
            columns += range(first, first + len(new))
            entries += new
        count = len(entries)
        if not count:
            return
        where = np.array((rows, columns, entries), dtype=np.int64)
        where = host_to_device(where, self.device)
        self.table.index_put_((where[0], where[1]), where[2])
        self.entries_uploaded += count


def _extends(blocks: list[int], passed_before: list[int], uploaded: list[int]) -> bool:
    """True when `blocks` starts with the entries uploaded: at once for the same append-only list
    object as last time, else by comparing them."""
    if blocks is passed_before:
        return len(blocks) >= len(uploaded)
    return blocks[:len(uploaded)] == uploaded
