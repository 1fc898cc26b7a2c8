"""A backend added the way the registry's docstring says (one module, one BACKENDS entry), for
tests/test_attention_backends.py: the torch backend's attention, counting its calls."""
from __future__ import annotations

from kvserve.model.attention.torch_backend import TorchBackend


class CountingBackend(TorchBackend):
    name = "counting"
    calls = 0

    def attend(self, query, key, value, pool, kv_format, meta, window):
        CountingBackend.calls += 1
        return super().attend(query, key, value, pool, kv_format, meta, window)
