# SPDX-License-Identifier: MIT
"""A pure-Python store with torch.distributed.Store's methods (set, get, wait, add, check, delete_key), for tests."""
import datetime
import threading


class DictStore:
    """Thread-safe, in one process. wait() raises TimeoutError naming the keys, as torch's stores raise on timeout."""

    def __init__(self):
        self._data = {}
        self._cond = threading.Condition()
        self.calls = []

    def set(self, key, value):
        if isinstance(value, str):
            value = value.encode()
        with self._cond:
            self.calls.append(("set", key))
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key):
        with self._cond:
            self.calls.append(("get", key))
            if key not in self._data:
                raise KeyError(key)
            return self._data[key]

    def wait(self, keys, timeout=datetime.timedelta(seconds=30)):
        deadline = timeout.total_seconds()
        with self._cond:
            self.calls.append(("wait", tuple(keys)))
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout=deadline):
                raise TimeoutError(f"wait timed out after {deadline:.3f} s for keys {list(keys)}")

    def add(self, key, delta):
        with self._cond:
            self.calls.append(("add", key))
            value = int(self._data.get(key, b"0")) + int(delta)
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def check(self, keys):
        with self._cond:
            self.calls.append(("check", tuple(keys)))
            return all(k in self._data for k in keys)

    def delete_key(self, key):
        with self._cond:
            self.calls.append(("delete_key", key))
            return self._data.pop(key, None) is not None

    def keys(self):
        with self._cond:
            return sorted(self._data)
