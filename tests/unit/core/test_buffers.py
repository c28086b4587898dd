"""ScratchPool: leases never share memory while in flight; released buffers are reused."""

import threading

import pytest
import torch

from regather.core.buffers import ScratchPool


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_in_flight_leases_never_share_a_buffer():
    pool = ScratchPool()
    a = pool.acquire("gather", (4, 8), torch.float32, "cpu")
    b = pool.acquire("gather", (4, 8), torch.float32, "cpu")
    assert _ptr(a.tensor) != _ptr(b.tensor)
    assert pool.in_flight("gather") == 2
    a.release()
    c = pool.acquire("gather", (2, 8), torch.float32, "cpu")  # smaller fits the freed one
    assert _ptr(c.tensor) == _ptr(a._storage) and c.tensor.shape == (2, 8)
    assert pool.allocations == 2
    b.release(), c.release()
    assert pool.in_flight() == 0


def test_keys_separate_purpose_dtype_and_device():
    pool = ScratchPool()
    leases = [pool.acquire("fwd", (8,), torch.float32, "cpu"),
              pool.acquire("bwd", (8,), torch.float32, "cpu"),
              pool.acquire("fwd", (8,), torch.bfloat16, "cpu")]
    for lease in leases:
        lease.release()
    assert pool.allocations == 3
    again = pool.acquire("bwd", (8,), torch.float32, "cpu")
    assert _ptr(again.tensor) == _ptr(leases[1]._storage)
    assert pool.allocations == 3


def test_too_small_buffer_is_replaced_not_kept():
    pool = ScratchPool()
    pool.acquire("x", (4,), torch.float32, "cpu").release()
    big = pool.acquire("x", (64,), torch.float32, "cpu")
    assert big.tensor.numel() == 64 and pool.allocations == 2
    big.release()
    assert pool.reserved_bytes() == 64 * 4  # the 4-element buffer was dropped


def test_double_release_is_an_error():
    pool = ScratchPool()
    lease = pool.acquire("x", (4,), torch.float32, "cpu")
    lease.release()
    with pytest.raises(RuntimeError, match="released twice"):
        lease.release()


def test_concurrent_acquire_gives_distinct_buffers():
    pool = ScratchPool()
    got, lock = [], threading.Lock()

    def take():
        lease = pool.acquire("x", (128,), torch.float32, "cpu")
        with lock:
            got.append(lease)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({_ptr(lease.tensor) for lease in got}) == 8
