"""The weight-sync pipeline: publish returns before the bytes are out, newer versions supersede unsent
ones, the learner exports what generators run (bf16, trainable parameters), ipc:// works, and on
CUDA the device->host copies are ordered before the caller's next kernels.

Real ZeroMQ sockets on loopback; every assertion is about order or content, none about time.
"""

from __future__ import annotations

import time

import pytest
import torch

from streamgrpo.transport.weights.layout import specs_of
from streamgrpo.transport.weights.publisher import WeightPublisher

WAIT_S = 30.0


def _wait_version(sub, version: int, timeout: float = WAIT_S):
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        got = sub.poll(0.2)
        if got is not None:
            seen.append(got[0])
            if got[0] >= version:
                return got, seen
    raise AssertionError(f"subscriber never got version {version} (saw {seen}, stats {sub.stats})")


def _until(pred, what: str, timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(8)}  # 8 x 16 KiB in 4 KiB chunks


@pytest.fixture
def channel(weight_subscriber_factory):
    """A publisher (4 KiB chunks) and a subscriber that already holds version 1."""
    with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=4 / 1024) as pub:
        sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port)
        pub.publish(1, _tensors(1))
        _wait_version(sub, 1)
        yield pub, sub


def test_publish_is_in_flight_while_the_caller_goes_on_and_what_went_out_is_what_was_written(channel):
    """begin/write/commit: chunks of the written half go out before the rest is written; tensors changed
    after their write (an optimizer step) do not change what is sent."""
    pub, sub = channel
    t = _tensors(2)
    expected = {k: v.clone() for k, v in t.items()}
    writer = pub.begin(2, specs_of(t))
    names = list(t)
    for name in names[:4]:
        writer.write(name, t[name])
    _until(lambda: pub.in_flight == 2, "the sender to take version 2")
    assert not pub.flush(0.2)  # version 2 is in flight: the sender waits for the rest ...
    assert pub.latest_version == 1 and sub.poll(0.2) is None  # ... and nobody has it yet
    with torch.no_grad():
        for name in names[:4]:
            t[name].add_(1.0)  # "the next optimizer step" while the publish is in flight
    for name in names[4:]:
        writer.write(name, t[name])
    writer.commit()
    (version, got), _ = _wait_version(sub, 2)
    assert version == 2 and all(torch.equal(got[k], expected[k]) for k in t)
    assert pub.flush(WAIT_S) and pub.latest_version == 2


def test_a_newer_version_replaces_one_that_has_not_started(channel):
    pub, sub = channel
    a = _tensors(10)
    writer = pub.begin(10, specs_of(a))  # the sender takes version 10 and waits for its bytes
    writer.write("w0", a["w0"])
    _until(lambda: pub.in_flight == 10, "the sender to take version 10")
    pub.publish(11, _tensors(11))  # queued behind 10 ...
    pub.publish(12, _tensors(12))  # ... and replaced before it started: never sent
    assert pub.superseded == 1
    for name in list(a)[1:]:
        writer.write(name, a[name])
    writer.commit()
    (version, got), seen = _wait_version(sub, 12)
    assert version == 12 and all(torch.equal(got[k], v) for k, v in _tensors(12).items())
    assert 11 not in seen and pub.flush(WAIT_S) and pub.versions_sent == 3  # 1, 10, 12


def test_an_aborted_version_is_never_applied(channel):
    pub, sub = channel
    t = _tensors(2)
    writer = pub.begin(2, specs_of(t))
    writer.write("w0", t["w0"])
    writer.abort()
    with pytest.raises(TypeError, match="'bad'"):
        pub.publish(3, {**_tensors(3), "bad": [1, 2]})  # a caller error never reaches the wire
    pub.publish(4, _tensors(4))
    (version, got), seen = _wait_version(sub, 4)
    # the last chunk can reach the subscriber before the sender thread marks the version latest: flush first
    assert seen == [4] and pub.flush(WAIT_S) and pub.latest_version == 4


def test_ipc_transport_delivers_to_a_same_host_generator(tmp_path, weight_subscriber_factory):
    from streamgrpo.transport.weights.subscriber import WeightSubscriber

    with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=4 / 1024, ipc_dir=tmp_path / "ipc") as pub:
        sub = WeightSubscriber(ipc_dir=tmp_path / "ipc")  # no ports: unix sockets in the run directory
        try:
            pub.publish(1, _tensors(5))
            (version, got), _ = _wait_version(sub, 1)
            assert all(torch.equal(got[k], v) for k, v in _tensors(5).items())
        finally:
            sub.close()
        assert (tmp_path / "ipc" / "weights-pub.sock").exists()


def test_learner_publishes_bf16_trainable_weights_not_the_fp32_master(tiny_model_dir, tmp_path,
                                                                      weight_subscriber_factory):
    from streamgrpo.config import load_config
    from streamgrpo.learner.trainer import Learner

    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={tmp_path}", "model.dtype=bfloat16",
                               "model.tune_mm_vision=false"])
    learner = Learner(cfg)
    params = dict(learner.module.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    frozen = {n for n, p in params.items() if not p.requires_grad}
    assert frozen and all("visual" in n for n in frozen)
    before = {n: p.detach().clone() for n, p in params.items()}
    with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64) as pub:
        sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port)
        learner.publish(pub, 3)
        with torch.no_grad():  # an optimizer step right after publish() returned changes nothing sent
            for p in params.values():
                p.add_(1.0)
        (version, got), _ = _wait_version(sub, 3)
    assert version == 3 and set(got) == set(params) - frozen
    for name, t in got.items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, before[name].to(torch.bfloat16)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_are_ordered_before_the_next_kernels(weight_subscriber_factory):
    """publish() returns before the device->host copies finish; a kernel queued right after it (on the
    caller's stream) must not change what is sent, and the bytes are the bf16 cast of the fp32 weights."""
    g = torch.Generator(device="cuda").manual_seed(0)
    t = {f"layer{i}.weight": torch.randn(1024, 1024, device="cuda", generator=g) for i in range(16)}
    t["steps"] = torch.arange(5, device="cuda")
    expected = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).cpu() for k, v in t.items()}
    with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1.0) as pub:
        sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, pin_memory=True)
        pub.publish(1, t, dtype=torch.bfloat16)
        with torch.no_grad():
            for v in t.values():
                if v.is_floating_point():
                    torch.cuda._sleep(1_000_000)  # keep the stream busy so the update lands while copies could run
                    v.mul_(-3.0)
        (version, got), _ = _wait_version(sub, 1)
        assert all(got[k].is_pinned() for k in got)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
