"""The stream order of a staged CUDA bucket's device copy of its averages (``Bucket.averages``), checked
on the CPU: recording fakes stand in for CUDA's streams and events, so the order of every wait and
record is seen, whatever device the test runs on. The GPU tests (test_cuda.py) check the same order
with real kernels, on a rank whose current device is the model's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from poseidon_torch.bucket import Bucket, Layer


class FakeEvent:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.device))


class FakeStream:
    def __init__(self, device: torch.device, log: list) -> None:
        self.device, self.log = device, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", event.name, self.device))


@pytest.fixture
def staged(monkeypatch):
    """A bucket whose averages were uploaded to a device copy, on a thread whose current CUDA device is
    not the bucket's (a rank that never called ``torch.cuda.set_device``); its log of waits and records."""
    log: list = []
    other = torch.device("cuda", 7)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: FakeStream(other if device is None else torch.device(device), log))
    fc = nn.Linear(3, 2)
    bucket = Bucket(0, [Layer("fc", fc, (("fc.weight", fc.weight), ("fc.bias", fc.bias)))])
    bucket.device_averages = torch.arange(bucket.grad_numel, dtype=torch.float32)
    bucket.uploaded_event, bucket.averages_read_event = FakeEvent("uploaded", log), FakeEvent("read", log)
    bucket.used_anywhere.fill_(1)
    return bucket, log


def test_a_reader_of_the_device_copy_waits_for_the_upload_on_the_stream_of_the_buckets_device(staged):
    bucket, log = staged
    with bucket.averages() as averages:
        log.append(("read",))
        values = [value.clone() for _, value in averages]
    assert log == [("wait", "uploaded", bucket.device), ("read",), ("record", "read", bucket.device)], log
    assert torch.equal(torch.cat([v.reshape(-1) for v in values]), bucket.device_averages)


def test_the_read_is_recorded_when_the_reader_raises(staged):
    """The next upload waits for the last reader's kernels; a block that raised after queueing some of
    them must still say where they run."""
    bucket, log = staged
    with pytest.raises(RuntimeError, match="reader failed"), bucket.averages():
        raise RuntimeError("reader failed")
    assert log[-1] == ("record", "read", bucket.device), log
