"""The stream order and lifetime of a staged CUDA bucket's device copy of its averages, checked on the
CPU: recording fakes stand in for CUDA's streams and events, so every wait and record is seen, whatever
device the test runs on. The GPU tests (test_cuda.py) check the order with real kernels, on a rank
whose current device is the model's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import workers
from poseidon_torch.bucket import Bucket, Layer
from workers import RecordingEvent


class FakeStream:
    def __init__(self, device: torch.device, log: list) -> None:
        self.device, self.log = device, log

    def wait_event(self, event: RecordingEvent) -> None:
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
    bucket.uploaded_event, bucket.averages_read_event = RecordingEvent("uploaded", log), RecordingEvent("read", log)
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


def test_releasing_the_device_copy_waits_for_its_last_upload(staged):
    """The upload runs on a side stream the training stream may never have waited for (a Pipe-SGD pass
    drained but not settled at close): its memory may go back to the allocator only once it landed."""
    bucket, log = staged
    bucket.release_device_copy()
    assert bucket.device_averages is None and log == [("synchronize", "uploaded")], log


def test_closing_releases_every_device_copy(cluster):
    """close() gives the device copies back at once: the closed engine stays reachable from the wrapper
    (and, after ``del``, until a garbage collection), which would keep a GPU model's gradients twice."""
    for result in cluster.run(workers.device_copies_after_close):
        assert result["held"] == [] and result["waited"] == result["buckets"], result
