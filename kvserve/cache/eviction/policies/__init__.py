"""The KV eviction policies: every module of this package is imported at start-up and each
`EvictionPolicy` subclass with a `name` it defines is registered, so a new policy is one file
here and nothing else (the engine's --kv-eviction choices, the HTTP `kv_eviction.policy` check
and `kvserve eval --long-context` read the registry)."""
from __future__ import annotations

import importlib
import pkgutil

from kvserve.cache.eviction.policy import EvictionPolicy


def discover(package: str) -> dict[str, type[EvictionPolicy]]:
    """Import every module of `package` and return its policies by name: first those without a
    scored share (recency baselines: streaming), then the others, by name."""
    found: dict[str, type[EvictionPolicy]] = {}
    root = importlib.import_module(package)
    for module_info in pkgutil.iter_modules(root.__path__):
        module = importlib.import_module(f"{package}.{module_info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, EvictionPolicy) and value.__module__ == module.__name__
                    and "name" in vars(value)):
                if value.name in found:
                    raise ValueError(f"two KV eviction policies are named {value.name!r}: "
                                     f"{found[value.name].__module__} and {module.__name__}")
                found[value.name] = value
    return dict(sorted(found.items(), key=lambda item: (item[1].scored_share, item[0])))


POLICIES = discover(__name__)
