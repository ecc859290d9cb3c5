"""Run every ``*.py`` sample in a folder, in name order, each in a fresh ``__main__`` namespace.

    python tests/snippet_runner.py DIR                          # the python samples
    torchrun --nproc_per_node 2 tests/snippet_runner.py DIR     # the torchrun samples, on every rank

A sample that raises ends the run with its traceback (the file name says which page and line it comes
from). Each torchrun sample initialises the default process group itself and must destroy it at its
end; it gets a rendezvous store of its own, since a second group over torchrun's one store would read
the previous group's addresses.
"""
from __future__ import annotations

import os
import runpy
import socket
import sys
from datetime import timedelta
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_rendezvous(index: int, launcher_port: int) -> None:
    """Point ``init_process_group``'s environment at a new store: rank 0 picks its port and hands it to
    the other ranks through torchrun's own store."""
    import torch.distributed as dist

    launcher = dist.TCPStore(os.environ["MASTER_ADDR"], launcher_port, is_master=False,
                             timeout=timedelta(seconds=120))
    key = f"snippet_runner/{index}/port"
    if os.environ["RANK"] == "0":
        launcher.set(key, str(free_port()))
    os.environ["MASTER_PORT"] = launcher.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def main() -> None:
    import torch.distributed as dist

    distributed = "RANK" in os.environ
    launcher_port = int(os.environ["MASTER_PORT"]) if distributed else 0
    for index, sample in enumerate(sorted(Path(sys.argv[1]).glob("*.py"))):
        if distributed:
            fresh_rendezvous(index, launcher_port)
        runpy.run_path(str(sample), run_name="__main__")
        if dist.is_initialized():
            raise RuntimeError(f"{sample.name} left the process group initialised: end it with "
                               f"dist.destroy_process_group()")
        print(f"ran {sample.name}", flush=True)


if __name__ == "__main__":
    main()
