"""Weight broadcast over real ZeroMQ sockets on loopback (free ports): issue 7's promises.

A generator applies a whole verified version or nothing; a slow or late generator catches up;
nobody without a listed CURVE key can read weights. Waits are bounded generously; nothing here
asserts on time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import torch
import zmq
from conftest import wait_weights_version as _wait_version
from prometheus_client import REGISTRY
from weights_reference import build_version, iter_chunks

from streamgrpo.config import WeightsConfig
from streamgrpo.models.apply import apply_to_model
from streamgrpo.models.lora import LoraApplier, filter_lora
from streamgrpo.transport.weights.codec import TOPIC, TOPIC_BEAT, encode_header
from streamgrpo.transport.weights.factory import publisher_from_config
from streamgrpo.transport.weights.publisher import WeightPublisher
from tests.paths import REPO

WAIT_S = 30.0


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and _bits(a[k]) == _bits(b[k])
                                      for k in a)


def _tensors(seed: int, big: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "f32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(4, 64, 9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(1000, generator=g).to(torch.float16),
        "f64": torch.randn(3, generator=g).double(),
        "i64": torch.randint(-(2**50), 2**50, (5, 7), generator=g),
        "i32": torch.randint(-(2**30), 2**30, (129,), generator=g, dtype=torch.int32),
        "i8": torch.randint(-128, 127, (3, 3, 3), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (70001,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(31, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed)),
        "empty": torch.zeros(0, 5),
        "transposed": torch.randn(8, 24, generator=g).t(),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(torch.bfloat16),
    }
    if big:
        out["big"] = torch.randn(big, generator=g).to(torch.bfloat16)
    return out


def _errors() -> float:
    return REGISTRY.get_sample_value("streamgrpo_errors_total", {"kind": "weights"}) or 0.0


def _until(pred, what: str, timeout: float = WAIT_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = pred()
        if out:
            return out
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("digest", ["xxh3_128", "sha256"])
def test_round_trip_is_bit_exact_for_many_dtypes_and_shapes(weight_subscriber_factory, digest):
    """Also with the standard library's sha256 (weights.digest) for subscribers written without xxhash."""
    cfg = WeightsConfig(pub_port=0, snapshot_port=0, chunk_mib=1 / 64, digest=digest)
    syncs = REGISTRY.get_sample_value("streamgrpo_weight_sync_seconds_count") or 0.0
    sent = REGISTRY.get_sample_value("streamgrpo_weight_bytes_total") or 0.0
    with publisher_from_config(cfg, "unused-for-tcp") as pub:
        assert pub.algo == digest
        sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port)
        for version in (1, 2, 3):
            t = _tensors(version, big=50_000 * version)  # versions differ in size too: many 16 KiB chunks
            pub.publish(version, t)
            got_version, got = _wait_version(sub, version)
            assert got_version == version and _same(got, t)
            assert sub.mark_applied() >= 0.0
        assert sub.version == 3 and sub.published_at is not None
        assert REGISTRY.get_sample_value("streamgrpo_policy_version", {"role": "learner"}) == 3
        assert REGISTRY.get_sample_value("streamgrpo_policy_version", {"role": "generator"}) == 3
        assert REGISTRY.get_sample_value("streamgrpo_weight_sync_seconds_count") == syncs + 3
        assert REGISTRY.get_sample_value("streamgrpo_weight_bytes_total") > sent + 3 * 100_000
        assert sub.poll(0.0) is None  # nothing newer


def test_late_subscriber_gets_the_latest_version_from_the_snapshot(weight_publisher, weight_subscriber_factory):
    pub = weight_publisher
    for version in (1, 2, 3):
        pub.publish(version, _tensors(version, big=20_000))
    assert pub.flush(WAIT_S)
    sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port)
    version, got = _wait_version(sub, 3)
    assert version == 3 and _same(got, _tensors(3, big=20_000))
    assert sub.stats["from_snapshot"] == 1
    late = weight_subscriber_factory(pub.pub_port, pub.snapshot_port)
    assert late.request_snapshot(WAIT_S)[0] == 3


def test_version_bigger_than_the_high_water_mark_arrives_whole_over_pub(weight_subscriber_factory):
    with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64, sndhwm=4) as pub:
        sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port)
        pub.publish(1, _tensors(1, big=1 << 20))  # ~2.3 MiB: 150 chunks, far over sndhwm=4
        _wait_version(sub, 1)  # (the PUB socket was rebuilt for it; version 1 may come via the snapshot)
        beats = sub.stats["beats"]
        _until(lambda: sub.stats["beats"] > beats, "a heartbeat: the subscriber is on the rebuilt PUB socket")
        discarded = sub.stats["discarded"]
        for version in (2, 3):
            pub.publish(version, _tensors(version, big=1 << 20))
            assert _same(_wait_version(sub, version)[1], _tensors(version, big=1 << 20))
        assert sub.stats["from_pub"] >= 2 and sub.stats["discarded"] == discarded  # no drops at the HWM


def test_lora_adapters_travel_and_merge_into_the_generator_model(weight_publisher, weight_subscriber_factory):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    learner = torch.nn.Sequential()
    learner.add_module("q_proj", torch.nn.Linear(16, 16))
    learner.add_module("v_proj", torch.nn.Linear(16, 16))
    generator = torch.nn.Sequential()
    generator.add_module("q_proj", torch.nn.Linear(16, 16))
    generator.add_module("v_proj", torch.nn.Linear(16, 16))
    generator.load_state_dict(learner.state_dict())
    learner = get_peft_model(learner, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.2)
    adapters = filter_lora(dict(learner.state_dict()))
    assert len(adapters) == 4  # only adapter tensors travel
    sub = weight_subscriber_factory(weight_publisher.pub_port, weight_publisher.snapshot_port)
    weight_publisher.publish(1, adapters)
    _, got = _wait_version(sub, 1)
    assert LoraApplier(generator, scale=16 / 4).apply(got) == 2
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(generator(x), learner(x), rtol=1e-4, atol=1e-5)  # merged vs unmerged maths


# ---------------------------------------------------------------- tampering and lost chunks
@pytest.fixture
def raw_channel():
    """A bare PUB socket (we craft the chunks) and a mute snapshot ROUTER that never answers."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    mute = ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    snap_port = mute.bind_to_random_port("tcp://127.0.0.1")
    yield pub, pub_port, snap_port
    ctx.destroy(linger=0)


def _send_version(pub, version: int, tensors, mutate=None, chunk_bytes: int = 4096, src: int = 11) -> int:
    meta, meta_bytes, buf = build_version(version, tensors, chunk_bytes, src=src, published_at=time.time())
    chunks = [(h, bytes(p)) for h, p in iter_chunks(meta, meta_bytes, buf)]
    if mutate is not None:
        chunks = mutate(chunks)
    for h, p in chunks:
        pub.send_multipart([TOPIC, encode_header(h), p])
    pub.send_multipart([TOPIC_BEAT, msgpack.packb({"s": src, "v": version})])  # as the publisher does
    return meta.n_chunks


def _first_version(pub, sub, tensors):
    """PUB has no history: resend version 1 until the subscriber has subscribed and got it."""

    def attempt():
        _send_version(pub, 1, tensors)
        return sub.poll(0.2)

    version, got = _until(attempt, "version 1 through the raw channel")
    assert version == 1 and _same(got, tensors)


def _flip_one_byte(chunks):
    h, p = chunks[2]
    chunks[2] = (h, p[:100] + bytes([p[100] ^ 0x10]) + p[101:])
    return chunks


def _drop_one_chunk(chunks):
    del chunks[3]
    return chunks


def _drop_last_chunk(chunks):  # nothing follows the gap but the heartbeat
    return chunks[:-1]


@pytest.mark.parametrize("damage", [_flip_one_byte, _drop_one_chunk, _drop_last_chunk],
                         ids=["tampered_byte", "missing_chunk", "missing_last_chunk"])
def test_damaged_version_is_never_applied_and_the_previous_stays(raw_channel, weight_subscriber_factory, damage):
    pub, pub_port, snap_port = raw_channel
    sub = weight_subscriber_factory(pub_port, snap_port, snapshot_timeout_s=1.0)
    _first_version(pub, sub, _tensors(1))
    errors, discarded = _errors(), sub.stats["discarded"]
    assert _send_version(pub, 2, _tensors(2, big=30_000), mutate=damage) > 4
    _until(lambda: sub.stats["discarded"] > discarded, "the damaged version to be discarded")
    assert _errors() > errors  # counted in streamgrpo_errors_total{kind="weights"}
    assert sub.poll(0.5) is None and sub.version == 1  # version 1 stays in force
    _send_version(pub, 3, _tensors(3))
    version, got = _wait_version(sub, 3)
    assert version == 3 and _same(got, _tensors(3))


# ------------------------------------------------------------------------------------- CURVE
def test_only_listed_curve_keys_receive_weights(curve_keys_dir, tmp_path, weight_subscriber_factory):
    from streamgrpo.transport.weights.keys import EVALUATOR, generate_keys

    # a rogue generator: it knows the server's public key but holds a key pair nobody listed
    rogue = tmp_path / "rogue"
    generate_keys(tmp_path / "other", clients=1)
    shutil.copytree(tmp_path / "other", rogue)
    shutil.copy(curve_keys_dir / "server.key", rogue / "server.key")
    (rogue / "server.key_secret").unlink()

    with WeightPublisher("127.0.0.1", 0, 0, 1 / 64, str(curve_keys_dir)) as pub:
        listed = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(curve_keys_dir),
                                           client_key="client-1")
        evaluator = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(curve_keys_dir),
                                              client_key=EVALUATOR)  # `streamgrpo keys` makes its pair too
        intruder = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(rogue),
                                             client_key="client-0")
        plain = weight_subscriber_factory(pub.pub_port, pub.snapshot_port)
        pub.publish(1, _tensors(1))
        assert _same(_wait_version(listed, 1)[1], _tensors(1))  # via the snapshot or PUB
        pub.publish(2, _tensors(2))
        assert _same(_wait_version(listed, 2)[1], _tensors(2))
        assert listed.stats["returned"] == 2
        assert _same(_wait_version(evaluator, 2)[1], _tensors(2))
        assert intruder.request_snapshot(1.0) is None and intruder.poll(0.5) is None
        assert plain.request_snapshot(1.0) is None and plain.poll(0.0) is None
        assert intruder.stats["returned"] == plain.stats["returned"] == 0


# ------------------------------------------------------------------------- stalled subscriber
_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from streamgrpo.transport.weights.subscriber import WeightSubscriber

    sub = WeightSubscriber("127.0.0.1", int(sys.argv[1]), int(sys.argv[2]))
    version, _ = sub.poll(60)
    print(json.dumps({"ready": version}), flush=True)
    target = int(sys.argv[3])
    while version < target:
        got = sub.poll(60)
        if got is not None:
            version, tensors = got
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    print(json.dumps({"version": version, "digest": h.hexdigest(), "stats": sub.stats}), flush=True)
    sub.close()
    """
)


@pytest.mark.slow
def test_stalled_subscriber_does_not_slow_the_publisher_and_recovers_from_the_snapshot():
    last = 7
    versions = {v: {"w": torch.randn(4 << 20, generator=torch.Generator().manual_seed(v)).to(torch.bfloat16)}
                for v in range(1, last + 1)}  # 8 MiB each, in 64 KiB chunks
    with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 16, sndhwm=16) as pub:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1")
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(pub.pub_port), str(pub.snapshot_port), str(last)],
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            pub.publish(1, versions[1])
            assert json.loads(child.stdout.readline()) == {"ready": 1}
            os.kill(child.pid, signal.SIGSTOP)  # the whole process stalls: its zmq I/O thread too
            for v in range(2, last + 1):  # 48 MiB: far more than the PUB queue (two versions) + socket buffers
                pub.publish(v, versions[v])
            assert pub.flush(120.0)  # everything handed to ZeroMQ while the subscriber is stopped
            assert pub.latest_version == last  # (queued versions a newer one overtook were skipped)
            os.kill(child.pid, signal.SIGCONT)
            result = json.loads(child.stdout.readline())
        finally:
            os.kill(child.pid, signal.SIGCONT)
            child.wait(60)
    h = hashlib.sha256()
    h.update(b"w")
    h.update(_bits(versions[last]["w"]))
    assert result["version"] == last and result["digest"] == h.hexdigest()
    assert result["stats"]["from_snapshot"] >= 1  # the last version was dropped on PUB: repaired via the snapshot


# ----------------------------------------------------------------------------- tiny Qwen model
def test_tiny_qwen_state_dict_travels_and_greedy_outputs_match(tiny_model_dir, weight_publisher,
                                                               weight_subscriber_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    learner = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(1234)  # the generator starts from a different random init of the same architecture
    generator = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    generator = generator.to(learner.dtype).eval()
    proc = AutoProcessor.from_pretrained(tiny_model_dir)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What colour is the square? (A) red (B) green"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], return_tensors="pt")
    with torch.no_grad():
        assert not torch.equal(learner(**inputs).logits, generator(**inputs).logits)

    sub = weight_subscriber_factory(weight_publisher.pub_port, weight_publisher.snapshot_port)
    weight_publisher.publish(7, dict(learner.state_dict()))
    version, tensors = _wait_version(sub, 7)
    ptr = generator.get_input_embeddings().weight.data_ptr()
    assert apply_to_model(generator, tensors, strict=True) == len(learner.state_dict())
    assert generator.get_input_embeddings().weight.data_ptr() == ptr  # copied in place
    sub.mark_applied()
    with torch.no_grad():
        assert torch.equal(learner(**inputs).logits, generator(**inputs).logits)
        a = learner.generate(**inputs, do_sample=False, max_new_tokens=12)
        b = generator.generate(**inputs, do_sample=False, max_new_tokens=12)
    assert a.shape[1] > inputs["input_ids"].shape[1] and torch.equal(a, b)


def test_a_weights_port_in_use_is_one_line_naming_the_setting():
    from streamgrpo.config import ConfigError

    with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64) as first:
        for taken, other in ((first.pub_port, 0), (0, first.snapshot_port)):
            with pytest.raises(ConfigError) as err:
                WeightPublisher("127.0.0.1", taken, other, chunk_mib=1 / 64)
            setting = "weights.pub_port" if taken else "weights.snapshot_port"
            msg = str(err.value)
            assert "\n" not in msg and setting in msg and "another process holds that port" in msg
        # the first publisher is unharmed: a second one on free ports starts fine next to it
        with WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64) as second:
            assert second.pub_port not in (first.pub_port, first.snapshot_port)


def test_weights_pull_writes_the_latest_version_to_safetensors(weight_publisher, tmp_path):
    """`streamgrpo weights pull` (the real CLI) gets the version a late joiner gets, bit for bit, with
    the learner's tensor names; with nothing published it gives up in one line, exit code 1."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    pub = weight_publisher
    ports = ["--set", f"weights.pub_port={pub.pub_port}", "--set", f"weights.snapshot_port={pub.snapshot_port}",
             "--set", f"run_dir={tmp_path / 'run'}"]
    cmd = [sys.executable, "-m", "streamgrpo", "weights", "pull", "--config", "demo", *ports]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    none = subprocess.run([*cmd, "--out", str(tmp_path / "none.safetensors"), "--timeout-s", "2"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert none.returncode == 1 and "no weight version from 127.0.0.1" in none.stdout and "Traceback" not in none.stderr
    for version in (1, 2):
        pub.publish(version, _tensors(version))
    assert pub.flush(WAIT_S)
    out = tmp_path / "w.safetensors"
    done = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("weights v2: ")
    sent = _tensors(2)
    got = load_file(str(out))
    assert _same({k: got[k] for k in sent if k in got}, sent) and got.keys() == sent.keys()  # (safetensors sorts names)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"streamgrpo_version": "2"}
