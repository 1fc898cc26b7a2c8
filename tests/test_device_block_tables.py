"""Device-resident block tables (engine/device_block_tables.py): a step uploads only the entries
its requests' tables gained; a table that changed otherwise is rewritten; rows are reused least
recently used first; row 0 stays the null block's. No model: plain tensors on CPU."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.device_block_tables import DeviceBlockTables


def read(tables: DeviceBlockTables, row: int, length: int) -> list[int]:
    return tables.table[row, :length].tolist()


def test_a_decoding_table_uploads_only_its_new_block():
    tables = DeviceBlockTables(num_rows=4, width=8, device=torch.device("cpu"))
    a, b = tables.rows(["a", "b"], [[5, 6], [7]])
    assert tables.entries_uploaded == 3
    for _ in range(3):  # decodes inside the same blocks: nothing to copy
        assert tables.rows(["a", "b"], [[5, 6], [7]]) == [a, b]
    assert tables.entries_uploaded == 3
    assert tables.rows(["b", "a"], [[7, 9], [5, 6]]) == [b, a]  # b crossed into a new block
    assert tables.entries_uploaded == 4
    assert read(tables, a, 2) == [5, 6] and read(tables, b, 2) == [7, 9]
    assert tables.table[0].tolist() == [0] * 8  # padding rows read the null block


def test_a_table_that_changed_is_rewritten_whole():
    tables = DeviceBlockTables(num_rows=2, width=8, device=torch.device("cpu"))
    (row,) = tables.rows(["a"], [[5, 6, 7]])
    # preempted, then allocated again into other blocks
    assert tables.rows(["a"], [[9, 3]]) == [row]
    assert read(tables, row, 2) == [9, 3]
    assert tables.entries_uploaded == 5


def test_rows_go_to_the_least_recently_used_request_not_in_the_step():
    tables = DeviceBlockTables(num_rows=2, width=4, device=torch.device("cpu"))
    tables.rows(["a", "b"], [[1], [2]])
    tables.rows(["a"], [[1]])  # b is now the least recently used
    row_b = tables.rows(["b"], [[2]])[0]
    (row_c,) = tables.rows(["c", "b"], [[3], [2]])[:1]
    assert row_c != row_b  # a's row, not b's, which is in the step
    assert read(tables, row_c, 1) == [3] and read(tables, row_b, 1) == [2]
    before = tables.entries_uploaded
    (row_a,) = tables.rows(["a"], [[1]])  # a lost its row: rewritten wherever it lands
    assert read(tables, row_a, 1) == [1] and tables.entries_uploaded == before + 1


def test_too_many_requests_or_too_wide_a_table_is_refused():
    tables = DeviceBlockTables(num_rows=1, width=2, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="more than 1 requests"):
        tables.rows(["a", "b"], [[1], [2]])
    with pytest.raises(ValueError, match="wider than 2"):
        tables.rows(["c"], [[1, 2, 3]])


def test_a_table_list_grown_in_place_uploads_only_its_new_entries():
    tables = DeviceBlockTables(num_rows=2, width=8, device=torch.device("cpu"))
    table = [4, 5]
    (row,) = tables.rows(["a"], [table])
    table.append(6)  # the same list, one block longer: no compare, one entry copied
    assert tables.rows(["a"], [table]) == [row] and tables.entries_uploaded == 3
    assert read(tables, row, 3) == [4, 5, 6]
    shorter = table[:1] + [9]  # another list: compared, and rewritten since it differs
    assert tables.rows(["a"], [shorter]) == [row] and read(tables, row, 2) == [4, 9]
    assert tables.entries_uploaded == 5


def test_device_rows_follow_the_cache_managers_tables_through_decode_preemption_and_reuse():
    """The manager's table lists are append-only while they are a request's (what the fast path
    relies on): the device rows equal the tables after every step, a preempted request's new
    table included."""
    from kvserve.cache.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request
    from kvserve.sampling_params import SamplingParams

    block_size = 4
    manager = KVCacheManager(12, block_size, True, "float32")
    tables = DeviceBlockTables(num_rows=3, width=8, device=torch.device("cpu"))
    requests = [Request(f"r{i}", list(range(i, i + 6)), SamplingParams(max_tokens=16)) for i in range(3)]

    def step(running: list[Request], new_tokens: int) -> None:
        for request in running:
            assert manager.allocate(request, new_tokens)
            request.num_computed_tokens += new_tokens
            request.token_ids.append(7)  # the token this step sampled
        ids = [r.request_id for r in running]
        rows = tables.rows(ids, [manager.block_table(i) for i in ids])
        for row, request_id in zip(rows, ids):
            table = manager.block_table(request_id)
            assert read(tables, row, len(table)) == table

    for request in requests:  # prompts
        assert manager.allocate(request, 6)
        request.num_computed_tokens = 6
    for _ in range(5):  # decodes: tables grow by a block every 4 tokens
        step(requests, 1)
    before = manager.block_table("r1")
    manager.free(requests[1])  # preempted: recomputed later into whatever blocks are free
    requests[1].num_computed_tokens = 0
    step(requests[::2], 1)
    assert manager.allocate(requests[1], requests[1].num_tokens - 1)
    requests[1].num_computed_tokens = requests[1].num_tokens - 1
    assert manager.block_table("r1") is not before
    for _ in range(3):
        step(requests, 1)
