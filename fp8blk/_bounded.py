"""One bounded cache for the whole package: a least-recently-used mapping with a size limit
and an optional hook for what falls out (to free device memory or descriptors it holds).

    cache = BoundedCache(2)
    cache.put("a", 1); cache.put("b", 2); cache.get("a"); cache.put("c", 3)
    sorted(cache.keys())   # ['a', 'c']: "b" was the least recently used
"""
from __future__ import annotations

from collections import OrderedDict


class BoundedCache:
    """At most ``maxsize`` entries; ``get`` marks a hit as most recent, ``put`` evicts the least
    recently used entry when full and calls ``on_evict(key, value)`` for it. Not thread-safe:
    callers that share one across threads hold their own lock."""

    __slots__ = ("maxsize", "on_evict", "_data")

    def __init__(self, maxsize: int, on_evict=None):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.on_evict = on_evict
        self._data = OrderedDict()

    def get(self, key, default=None):
        data = self._data
        value = data.get(key, _MISSING)
        if value is _MISSING:
            return default
        data.move_to_end(key)
        return value

    def put(self, key, value):
        data = self._data
        data[key] = value
        data.move_to_end(key)
        while len(data) > self.maxsize:
            old_key, old = data.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old_key, old)
        return value

    def pop(self, key, default=None):
        return self._data.pop(key, default)

    def clear(self):
        """Drop every entry, calling ``on_evict`` for each."""
        while self._data:
            key, value = self._data.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(key, value)

    def keys(self):
        return self._data.keys()

    def values(self):
        return self._data.values()

    def __contains__(self, key):
        return key in self._data

    def __len__(self):
        return len(self._data)


_MISSING = object()
