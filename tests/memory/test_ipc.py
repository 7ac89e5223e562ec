import mmap
import multiprocessing
import os
import stat
import threading

import pytest
import torch

from rollplex.memory.ipc import (
    HandleServer,
    HandleSpec,
    attach_regions,
    receive_handles,
    share_regions,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def memfd(content: bytes) -> int:
    fd = os.memfd_create("rollplex-test")
    os.write(fd, content)
    return fd


def read_fd(fd: int, num_bytes: int) -> bytes:
    with mmap.mmap(fd, num_bytes) as view:
        return bytes(view[:num_bytes])


def receive_and_double(path: str, results) -> None:
    """In a spawned process: map each received memfd, check it, double every byte in place."""
    before = open_fds()
    for spec, fd in receive_handles(path):
        with mmap.mmap(fd, spec.num_bytes) as view:
            ok = bytes(view) == bytes(range(spec.num_bytes))
            view[:] = bytes(2 * b % 256 for b in bytes(view))
        os.close(fd)
        results.put((spec.name, ok))
    results.put(("leaked fds", len(open_fds() - before)))


def test_another_process_maps_the_same_pages_through_the_socket():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    sizes = {"a": 16, "b": 100, "c": 255}
    fds = {name: memfd(bytes(range(n))) for name, n in sizes.items()}
    with HandleServer(timeout_s=60) as server:
        child = context.Process(target=receive_and_double, args=(server.path, results))
        child.start()
        before = open_fds()
        server.send([HandleSpec(name, n) for name, n in sizes.items()], list(fds.values()))
        child.join(60)
    assert child.exitcode == 0
    assert sorted(results.get(timeout=5) for _ in range(4)) == [
        ("a", True),
        ("b", True),
        ("c", True),
        ("leaked fds", 0),
    ]
    for name, n in sizes.items():
        assert read_fd(fds[name], n) == bytes(2 * b % 256 for b in range(n)), "writes of the peer are seen here"
        os.close(fds[name])
    assert open_fds() <= before


def test_the_socket_lives_in_a_private_directory_removed_once_a_peer_connects():
    with HandleServer() as server:
        assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(server.path).st_mode)
        fd = memfd(b"x")
        thread = threading.Thread(target=lambda: [os.close(f) for _, f in receive_handles(server.path)])
        thread.start()
        server.send([HandleSpec("x", 1)], [fd])
        thread.join()
        os.close(fd)
        assert not os.path.exists(server.directory)


def test_closing_an_unused_server_removes_its_socket_and_directory():
    server = HandleServer()
    directory = server.directory
    server.close()
    server.close()
    assert not os.path.exists(directory)


def test_a_server_dropped_without_close_cleans_up_too():
    server = HandleServer()
    directory = server.directory
    del server
    assert not os.path.exists(directory)


def test_more_descriptors_than_one_message_holds_arrive_in_order():
    fds = [memfd(bytes([i % 256])) for i in range(450)]
    received = []
    with HandleServer() as server:
        thread = threading.Thread(target=lambda: received.extend(receive_handles(server.path)))
        thread.start()
        server.send([HandleSpec(f"r{i}", 1) for i in range(450)], fds)
        thread.join()
    assert [spec.name for spec, _ in received] == [f"r{i}" for i in range(450)]
    assert all(read_fd(fd, 1) == bytes([i % 256]) for i, (_, fd) in enumerate(received))
    for fd in fds + [fd for _, fd in received]:
        os.close(fd)


def test_a_server_nobody_connects_to_times_out_with_a_clear_error():
    with HandleServer(timeout_s=0.2) as server, pytest.raises(TimeoutError, match="no process connected"):
        server.send([], [])
    assert not os.path.exists(server.directory)


def test_specs_and_descriptors_must_pair_up():
    with HandleServer() as server, pytest.raises(ValueError, match="2 specs for 1 file descriptors"):
        server.send([HandleSpec("a", 1), HandleSpec("b", 1)], [0])


def attach_read_and_write(path: str, results) -> None:
    """In a spawned process: import the regions, check the tensor, write into it, report."""
    from rollplex.memory.vmm import VmmArena

    with VmmArena(64 << 20) as arena:
        regions = attach_regions(arena, path)
        weights = arena.tensor(regions["weights"], torch.float32, (1024, 1024))
        results.put(bool(torch.equal(weights, torch.arange(1 << 20, device="cuda").float().view(1024, 1024))))
        weights.mul_(2)
        torch.cuda.synchronize()
    results.put("closed")


@pytest.mark.gpu
@needs_cuda
def test_a_spawned_process_reads_and_writes_a_tensor_of_this_one_through_imported_handles():
    from rollplex.memory.vmm import VmmArena

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with VmmArena(64 << 20) as arena, HandleServer(timeout_s=120) as server:
        region = arena.allocate(4 << 20, "weights")
        weights = arena.tensor(region, torch.float32, (1024, 1024))
        weights.copy_(torch.arange(1 << 20, device="cuda").float().view(1024, 1024))
        torch.cuda.synchronize()
        child = context.Process(target=attach_read_and_write, args=(server.path, results))
        child.start()
        share_regions(server, arena, [region])
        assert results.get(timeout=120) is True, "the child sees this process's values"
        assert results.get(timeout=120) == "closed"
        child.join(60)
        assert child.exitcode == 0
        expected = 2 * torch.arange(1 << 20, device="cuda").float().view(1024, 1024)
        assert torch.equal(weights, expected), "this process sees the child's writes"
