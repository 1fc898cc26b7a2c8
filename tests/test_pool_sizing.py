"""The CUDA KV budget's accounting (engine/pool_sizing.budget_after_profile), from device readings:
what --gpu-memory-utilization leaves once the profiled peak, the reserves and the memory that grew
outside torch's allocator are set aside, and a clear refusal when the GPU is not free enough."""
from __future__ import annotations

import pytest

from kvserve.engine.pool_sizing import DeviceMemory, budget_after_profile
from kvserve.engine.preflight import CapacityError
from kvserve.units import GiB

TOTAL = 80 * GiB


def reading(outside_torch: float, reserved: float) -> DeviceMemory:
    """A device of TOTAL bytes whose torch allocator holds `reserved` GiB and the rest `outside_torch` GiB."""
    return DeviceMemory(TOTAL, TOTAL - int((outside_torch + reserved) * GiB), int(reserved * GiB))


def test_the_budget_is_the_target_less_peak_reserves_and_what_grew_outside_torch():
    start = reading(outside_torch=0.5, reserved=16)  # the CUDA context; the weights
    end = reading(outside_torch=0.75, reserved=16)  # Triton's and cuBLAS's modules loaded while profiling
    budget = budget_after_profile(0.9, start, end, peak=20 * GiB,
                                  set_aside={"CUDA graphs": 1 * GiB, "decode scratch": GiB // 2})
    assert budget == int(TOTAL * 0.9) - 20 * GiB - GiB - GiB // 2 - GiB // 4
    # memory given back outside torch counts as nothing, not as a bonus
    assert budget_after_profile(0.9, end, start, 20 * GiB, {}) == int(TOTAL * 0.9) - 20 * GiB


def test_a_gpu_that_other_processes_hold_is_refused_with_the_option_to_change():
    start = reading(outside_torch=30, reserved=16)  # another process holds 29.5 GiB
    with pytest.raises(CapacityError, match=r"--gpu-memory-utilization 0.9 asks for 72.00 GiB of this GPU's "
                                            r"80.00 GiB, but other processes and the CUDA context hold 30.00 GiB"):
        budget_after_profile(0.9, start, start, 20 * GiB, {})
    assert budget_after_profile(0.6, start, start, 20 * GiB, {}) == int(TOTAL * 0.6) - 20 * GiB


def test_no_room_left_names_what_was_set_aside():
    start = reading(outside_torch=0.5, reserved=16)
    with pytest.raises(CapacityError, match=r"no memory left for the KV cache: .*CUDA graphs 3.00 GiB, "
                                            r"outside torch 0.00 GiB"):
        budget_after_profile(0.5, start, start, 37 * GiB, {"CUDA graphs": 3 * GiB})
