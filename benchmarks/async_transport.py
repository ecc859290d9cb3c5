"""Which transport can carry asynchronous parameter-server traffic (issue 23): gloo point-to-point with
receives from any source, or torch's own RPC layer (``torch.distributed.rpc``, TensorPipe).

Asynchronous SGD needs an owner to serve whichever worker pushes next: gloo matches a send with a
receive by order, so either the owner receives from *any* source (``dist.recv(t, src=None)``) or the
workers call the owner (RPC). This measures, on 2..N processes of this machine, the round trip of one
push (a payload of S bytes from every worker to rank 0, which adds it into its buffer) followed by a
pull (rank 0's buffer back to the worker), for each transport, while every worker pushes at once:

    python benchmarks/async_transport.py [--workers 2] [--sizes 4096,262144,2097152] [--rounds 50]

Prints the median round trip per size and transport (and the spread over the workers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

_BUFFER: dict[int, torch.Tensor] = {}
_LOCK = threading.Lock()


def _add_and_read(size: int, payload: torch.Tensor) -> torch.Tensor:
    """The owner's side of an RPC push + pull."""
    with _LOCK:
        buffer = _BUFFER.setdefault(size, torch.zeros_like(payload))
        buffer += payload
        return buffer.clone()


def _gloo_owner(sizes: list[int], rounds: int, workers: int) -> None:
    """Serve every worker's pushes in arrival order: a header from any source names the size; then the
    payload from that source, the add, and the buffer back."""
    buffers = {size: torch.zeros(size // 4) for size in sizes}
    header = torch.zeros(1, dtype=torch.int64)
    for _ in range(len(sizes) * rounds * workers):
        source = dist.recv(header, src=None, tag=1)
        size = int(header)
        payload = torch.empty(size // 4)
        dist.recv(payload, src=source, tag=2)
        buffers[size] += payload
        dist.send(buffers[size], dst=source, tag=3)


def _gloo_round(size: int) -> float:
    payload = torch.ones(size // 4)
    out = torch.empty(size // 4)
    start = time.perf_counter()
    dist.send(torch.tensor([size], dtype=torch.int64), dst=0, tag=1)
    dist.send(payload, dst=0, tag=2)
    dist.recv(out, src=0, tag=3)
    return time.perf_counter() - start


def _rpc_round(size: int) -> float:
    payload = torch.ones(size // 4)
    start = time.perf_counter()
    rpc.rpc_sync("owner", _add_and_read, args=(size, payload))
    return time.perf_counter() - start


def _run(rank: int, world: int, port: int, sizes: list[int], rounds: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mine: dict[str, dict[int, list[float]]] = {"gloo any-source": {}, "rpc": {}}
    if rank == 0:
        _gloo_owner(sizes, rounds, world - 1)
    else:
        for size in sizes:
            mine["gloo any-source"][size] = [_gloo_round(size) for _ in range(rounds)]
    dist.barrier()
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port + 1}")
    rpc.init_rpc("owner" if rank == 0 else f"worker{rank}", rank=rank, world_size=world,
                 rpc_backend_options=options)
    if rank != 0:
        for size in sizes:
            mine["rpc"][size] = [_rpc_round(size) for _ in range(rounds)]
    rpc.shutdown()
    results[rank] = mine
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="pushing processes besides the owner")
    parser.add_argument("--sizes", default="4096,262144,2097152", help="payload bytes")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    world = args.workers + 1
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_run, args=(world, port, sizes, args.rounds, results), nprocs=world, join=True)
    print(f"{args.workers} workers pushing to one owner at once, {args.rounds} rounds; round trip push + pull, ms")
    print(f"{'bytes':>9} {'transport':>16} {'median':>8} {'workers min-max':>16}")
    for size in sizes:
        for transport in ("gloo any-source", "rpc"):
            medians = [statistics.median(results[r][transport][size]) * 1e3 for r in range(1, world)]
            print(f"{size:9d} {transport:>16} {statistics.median(medians):8.3f} "
                  f"{min(medians):7.3f}-{max(medians):<8.3f}")


if __name__ == "__main__":
    main()
