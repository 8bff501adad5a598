"""A codec with two round trips per step fits the server without changing it.

``twice`` is a test-only codec in the shape of PowerSGD: the first round of every step is an
intermediate one whose aggregate (here: the sum of the workers' payloads) is sent back to the
pushers, and the second round's aggregate is stored. The server code is the same as for 2-bit.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from kvtest import RawClient

from kvstore.codecs import register_codec
from kvstore.codecs.base import Aggregator, Codec, frame_array
from kvstore.codecs.identity import _HostIdentityEncoder
from kvstore.config import ServerConfig
from kvstore.server import ShardServer

pytestmark = pytest.mark.integration


class _TwiceAggregator(Aggregator):
    def __init__(self, numel: int, dtype: str) -> None:
        super().__init__(numel, dtype)
        self.round = 0

    def add(self, payloads, first):
        values = frame_array(payloads[0], np.float32, self.numel)
        if first:
            np.copyto(self.result, values)
        else:
            self.result += values

    def finish(self):
        self.round += 1
        return [self.result.copy()] if self.round % 2 == 1 else None


@register_codec
class _TwiceCodec(Codec):
    name = "test-twice"
    dtypes = frozenset({"float32"})

    def payload_nbytes(self, numel, dtype):
        return (4 * numel,)

    def make_encoder(self, numel, dtype, device=None):
        return _HostIdentityEncoder(numel, dtype)

    def make_aggregator(self, numel, dtype):
        return _TwiceAggregator(numel, dtype)


@pytest.fixture
def in_process_server():
    """The server in a thread of this process, so it sees the test-only codec."""
    loop = asyncio.new_event_loop()
    server = ShardServer(ServerConfig(num_workers=2, threads=2))
    started = threading.Event()
    address: list[str] = []

    def run():
        asyncio.set_event_loop(loop)
        address.append(loop.run_until_complete(server.start()))
        started.set()
        loop.run_forever()
        loop.run_until_complete(server.stop())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(30)
    yield address[0]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def test_intermediate_rounds_are_sent_back_and_the_last_one_stored(in_process_server):
    a, b = RawClient(in_process_server), RawClient(in_process_server)
    try:
        for rank, c in enumerate((a, b)):
            assert c.hello(rank=rank, num_workers=2).fields == {"sr": 0}
        init = {"k": "m", "c": 0, "o": 0, "n": 3, "dt": "float32", "sh": [3]}
        init.update(cd="test-twice", cp={})
        a.send("INIT", init, [np.zeros(3, np.float32)])
        b.send("INIT", init)
        assert a.receive().rid and b.receive().rid
        push = {"k": "m", "c": 0, "n": 3}
        # round 1 (intermediate): the sum comes back to both, the stored value is unchanged
        a.send("PUSHPULL", push, [np.full(3, 1, np.float32)])
        b.send("PUSHPULL", push, [np.full(3, 2, np.float32)])
        for c in (a, b):
            assert np.frombuffer(c.receive().payloads[0], np.float32).tolist() == [3, 3, 3]
        assert np.frombuffer(
            a.request("PULL", {"k": "m", "c": 0, "af": 1}).payloads[0], np.float32
        ).tolist() == [0, 0, 0]
        # round 2 (final): stored and returned as the key's value
        a.send("PUSHPULL", push, [np.full(3, 10, np.float32)])
        b.send("PUSHPULL", push, [np.full(3, 20, np.float32)])
        for c in (a, b):
            assert np.frombuffer(c.receive().payloads[0], np.float32).tolist() == [30, 30, 30]
    finally:
        a.close()
        b.close()
