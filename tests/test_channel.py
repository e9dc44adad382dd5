"""The driver-worker control channel (distributed/channel.py) between two spawned processes over
gloo: messages of every size across its chunk boundaries arrive whole, a receive with a timeout
ends in TimeoutError, and a receive from a process that exited fails instead of waiting."""

from __future__ import annotations

import datetime
import multiprocessing
import pickle
import traceback

import torch.distributed as dist

from ostinato.distributed import channel as channel_module
from ostinato.distributed.channel import Channel

CHUNK = channel_module._CHUNK
# a message is its 8-byte length and the pickled payload, padded to whole chunks: these
# totals fall one short of a chunk, on it, one past it, on three, and past a hundred
TOTALS = [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 100 * CHUNK + 5]


def payload_of_total(total: int) -> bytes:
    """Bytes whose pickled message (8 + pickled length) is exactly `total` bytes, every byte
    position distinct in a pattern of 251."""
    for n in range(total - 8, total - 40, -1):
        data = bytes(i % 251 for i in range(n))
        if 8 + len(pickle.dumps(data, pickle.HIGHEST_PROTOCOL)) == total:
            return data
    raise AssertionError(f"no payload makes a {total}-byte message")


def _rank(rank: int, init: str, results, sender_left) -> None:
    """Rank 0 sends TOTALS' payloads and a last small message, then waits until rank 1 has
    timed out once before it exits; rank 1 receives them, times out waiting for more, and then
    receives from rank 0 after it exited."""
    try:
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        channel = Channel(dist.group.WORLD)
        if rank == 0:
            for total in TOTALS:
                channel.send(payload_of_total(total), 1)
            channel.send({"last": [1, 2, 3]}, 1)
            assert channel.flush(timeout=30)
            results.put(("sent", None))
            sender_left.wait(60)  # until rank 1's timeout was seen: then this process exits
            return
        got = [channel.recv(0, timeout=30) for _ in TOTALS]
        results.put(("sizes", [len(g) for g in got]))
        results.put(("equal", [g == payload_of_total(t) for g, t in zip(got, TOTALS, strict=True)]))
        results.put(("last", channel.recv(0)))
        try:
            channel.recv(0, timeout=0.5)
            results.put(("timeout", "returned"))
        except TimeoutError as e:
            results.put(("timeout", str(e)))
        sender_left.set()
        try:
            Channel(dist.group.WORLD).recv(0)  # rank 0 has exited or is exiting
            results.put(("after exit", "returned"))
        except RuntimeError:  # gloo's connection closed (DistBackendError is one too)
            results.put(("after exit", "raised"))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def test_messages_cross_chunk_boundaries_and_receives_end(tmp_path):
    """Every total around a chunk boundary arrives whole and equal; a receive with a timeout
    ends in TimeoutError naming the rank; a receive from a process that exited raises instead
    of waiting for ever. Neither process outlives the test."""
    ctx = multiprocessing.get_context("spawn")
    results, sender_left = ctx.Queue(), ctx.Event()
    init = f"file://{tmp_path / 'store'}"
    ranks = [ctx.Process(target=_rank, args=(r, init, results, sender_left)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(120)
        got = {}
        while not results.empty():
            key, value = results.get()
            assert key != "error", value
            got[key] = value
    finally:
        for p in ranks:
            p.kill()
            p.join(5)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert got["sent"] is None
    want = [len(payload_of_total(t)) for t in TOTALS]
    assert got["sizes"] == want and all(got["equal"])
    assert got["last"] == {"last": [1, 2, 3]}
    assert got["timeout"] == "no message from rank 0 in time"
    assert got["after exit"] == "raised"
