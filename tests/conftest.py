import gc
import weakref

import pytest

from cbserve.workers.engine import EngineCore

# Every engine built in this process, so that each test can check that pages always come back.
LIVE_ENGINES: weakref.WeakSet[EngineCore] = weakref.WeakSet()
_engine_init = EngineCore.__init__


def _tracked_init(self, *args, **kwargs) -> None:
    _engine_init(self, *args, **kwargs)
    LIVE_ENGINES.add(self)


EngineCore.__init__ = _tracked_init


@pytest.fixture(autouse=True)
def pages_return_to_total():
    """After every test, every engine's free pages equal its total: nothing leaks."""
    yield
    if not LIVE_ENGINES:  # most tests build no engine: skip the (slow) collection
        return
    gc.collect()
    for engine in list(LIVE_ENGINES):
        bm = engine.block_manager
        assert bm.num_free == bm.num_blocks, f"KV pages leaked: {bm.num_free} free of {bm.num_blocks}"
    LIVE_ENGINES.clear()
