"""A launch that must not hang (divergent barriers) runs on a helper thread, so a hang
fails the test instead of stalling the whole run. Shared by the emulator and sanitizer
tests (tests/conftest.py puts this directory on sys.path)."""
from __future__ import annotations

import threading

# A launch in these tests takes well under a second; one that hung would never return.
TIMEOUT_S = 60.0


def call_with_timeout(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a helper thread; its exception is re-raised here."""
    box = {}

    def target():
        try:
            fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(TIMEOUT_S)
    assert not t.is_alive(), f"launch still running after {TIMEOUT_S} s: the emulator hangs"
    if "error" in box:
        raise box["error"]
