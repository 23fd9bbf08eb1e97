"""The ScoredGroup wire format: bit-exact round trips, zero-copy decode, field-naming errors, fuzzing."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamgrpo.wire import (
    MAGIC,
    SCHEMA_VERSION,
    Completion,
    ScoredGroup,
    Visual,
    WireError,
    decode,
    encode,
)


def make_group(seed: int = 0, n_videos: int = 2, g: int = 4) -> ScoredGroup:
    rng = np.random.default_rng(seed)
    visuals = [
        Visual("video", rng.integers(0, 256, (3 + i, 28, 56, 3), dtype=np.uint8), fps=2.0 + i,
               frame_indices=np.arange(3 + i, dtype=np.int32) * 7)
        for i in range(n_videos)
    ]
    visuals.append(Visual("image", rng.integers(0, 256, (1, 56, 28, 3), dtype=np.uint8)))
    completions = []
    for i in range(g):
        n = 5 + i
        lp = -np.abs(rng.standard_normal(n)).astype(np.float32)  # log-probabilities: at most 0
        lp[0] = -0.0  # bit patterns that a float round trip through text would lose
        if n > 3:
            lp[1], lp[2], lp[3] = np.float32(-999.99994), -np.float32(1e-45), np.float32(1e-45)
        completions.append(Completion(
            token_ids=rng.integers(0, 2**31 - 1, n, dtype=np.int64).astype(np.int32),
            logprobs=lp, text=f"<think>t{i}</think> <answer>(B) é中</answer>", finish_reason="stop" if i else "length",
            rewards={"format": 1.0, "accuracy": float(i % 2)}, reward=0.3 + 0.7 * (i % 2),
        ))
    return ScoredGroup(
        prompt_id="rec-17", generator_id="gen-1", policy_version=42, model_id="tiny/qwen2_5_vl",
        prompt_ids=np.array([151644, 0, -1, 2**31 - 1, -(2**31)], dtype=np.int32), visuals=visuals,
        answer="(B) Collision", completions=completions, prompt_text="<|im_start|>user ...",
        meta={"kind": "multi_video", "temperature": 1.0, "nested": {"list": [1, "a", None, True]}},
    )


def assert_same_array(a, b) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()  # bit-exact (NaN payloads, -0.0, denormals)


def assert_same_group(a: ScoredGroup, b: ScoredGroup) -> None:
    for name in ("prompt_id", "generator_id", "policy_version", "model_id", "answer", "prompt_text", "group_id",
                 "created_at", "schema"):
        assert getattr(a, name) == getattr(b, name), name
    assert_same_array(a.prompt_ids, b.prompt_ids)
    assert len(a.visuals) == len(b.visuals)
    for va, vb in zip(a.visuals, b.visuals):
        assert (va.kind, va.fps) == (vb.kind, vb.fps)
        assert_same_array(va.frames, vb.frames)
        assert_same_array(va.frame_indices, vb.frame_indices)
    assert len(a.completions) == len(b.completions)
    for ca, cb in zip(a.completions, b.completions):
        assert_same_array(ca.token_ids, cb.token_ids)
        assert_same_array(ca.logprobs, cb.logprobs)
        if ca.versions is not None:
            assert_same_array(ca.versions, cb.versions)
        assert (ca.text, ca.finish_reason, ca.rewards, ca.reward) == (cb.text, cb.finish_reason, cb.rewards, cb.reward)


def test_round_trip_bit_exact_multi_video():
    g = make_group(n_videos=3)
    out = decode(encode(g))
    assert_same_group(g, out)
    assert [v.frames.shape[0] for v in out.visuals] == [3, 4, 5, 1]
    assert out.meta == g.meta
    lp = out.completions[0].logprobs
    assert lp[1] == np.float32(-999.99994) and lp[3] == np.float32(1e-45) and np.signbit(lp[0]) and np.signbit(lp[2])


def test_decode_is_zero_copy_and_aligned():
    data = encode(make_group())
    out = decode(data)
    whole = np.frombuffer(data, dtype=np.uint8)
    for arr in [out.prompt_ids, *(v.frames for v in out.visuals), *(c.logprobs for c in out.completions)]:
        assert np.shares_memory(arr, whole)
        assert arr.ctypes.data % 8 == 0
        assert not arr.flags.writeable  # a view of immutable bytes


def test_generic_arrays_in_meta_bf16_f32_i32_and_more():
    rng = np.random.default_rng(1)
    bf = torch.randn(3, 5, dtype=torch.float32).to(torch.bfloat16)
    bf[0, 0] = float("nan")
    meta = {
        "bf16": bf,
        "f32": rng.standard_normal((2, 3)).astype(np.float32),
        "i32": np.array([[-(2**31), 2**31 - 1]], dtype=np.int32),
        "f16": np.array([1.5, -0.0], dtype=np.float16),
        "i64": np.arange(4, dtype=np.int64),
        "u8": np.arange(3, dtype=np.uint8),
        "bool": np.array([True, False]),
        "scalar0d": np.array(3.25, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "big_endian": np.arange(3, dtype=">i4"),
        "strided": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],
        "torch_f32": torch.arange(4, dtype=torch.float32),
        "list": [np.arange(2, dtype=np.int32), {"deep": np.ones(1, dtype=np.float64)}],
    }
    g = make_group()
    g.meta = meta
    out = decode(encode(g)).meta
    assert out["bf16"].dtype == torch.bfloat16 and out["bf16"].shape == (3, 5)
    assert torch.equal(out["bf16"].view(torch.int16), bf.view(torch.int16))  # bits, NaN included
    for key in ("f32", "i32", "f16", "i64", "u8", "bool", "scalar0d", "empty"):
        assert_same_array(out[key], meta[key])
    assert out["big_endian"].dtype == np.dtype("<i4") and out["big_endian"].tolist() == [0, 1, 2]
    assert out["strided"].tolist() == [[0, 2], [4, 6], [8, 10]]
    assert out["torch_f32"].dtype == np.float32 and out["torch_f32"].tolist() == [0, 1, 2, 3]
    assert out["list"][1]["deep"].tolist() == [1.0]


def test_encode_casts_to_contract_dtypes():
    g = make_group()
    g.prompt_ids = torch.tensor([1, 2, 3])  # int64 tensor, as processors return it
    g.completions[0].token_ids = list(range(len(g.completions[0].logprobs)))
    g.completions[0].logprobs = g.completions[0].logprobs.astype(np.float64)
    g.completions[0].reward = np.float32(0.5)
    out = decode(encode(g))
    assert out.prompt_ids.dtype == np.int32 and out.prompt_ids.tolist() == [1, 2, 3]
    assert out.completions[0].token_ids.dtype == np.int32
    assert out.completions[0].logprobs.dtype == np.float32
    assert out.completions[0].reward == 0.5


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda g: setattr(g.completions[2], "logprobs", np.zeros(1, np.float32)), "completions[2].logprobs"),
        (lambda g: setattr(g.visuals[1], "kind", "audio"), "visuals[1].kind"),
        (lambda g: setattr(g.visuals[0], "frames", np.zeros((2, 4, 4), np.uint8)), "visuals[0].frames"),
        (lambda g: setattr(g.visuals[0], "frames", np.zeros((2, 4, 4, 3), np.float32)), "visuals[0].frames"),
        (lambda g: setattr(g.visuals[0], "frame_indices", np.arange(9, dtype=np.int32)), "visuals[0].frame_indices"),
        (lambda g: setattr(g, "prompt_ids", np.array([2**40])), "prompt_ids"),
        (lambda g: setattr(g, "policy_version", -1), "policy_version"),
        (lambda g: setattr(g, "group_id", ""), "group_id"),
        (lambda g: setattr(g, "schema", 99), "schema"),
        (lambda g: setattr(g.completions[1], "reward", float("nan")), "completions[1].reward"),
        (lambda g: g.completions[1].logprobs.__setitem__(2, np.nan), "completions[1].logprobs"),
        (lambda g: g.completions[0].logprobs.__setitem__(0, -np.inf), "completions[0].logprobs"),
        (lambda g: g.completions[2].token_ids.__setitem__(1, -1), "completions[2].token_ids"),
        (lambda g: g.completions[3].rewards.update(format="high"), "completions[3].rewards['format']"),
        (lambda g: setattr(g, "completions", []), "completions"),
        (lambda g: setattr(g, "answer", None), "answer"),
        (lambda g: g.meta.update(obj=object()), "meta"),
    ],
)
def test_encode_names_the_bad_field(mutate, field):
    g = make_group()
    mutate(g)
    with pytest.raises(WireError) as info:
        encode(g)
    assert str(info.value).startswith(field + ":"), str(info.value)


def _frame(header: dict, body: bytes = b"") -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    pad = -(16 + len(head)) % 8
    return struct.pack("<4sIQ", MAGIC, len(head), len(body)) + head + bytes(pad) + body


def _header_of(data: bytes) -> dict:
    _, hlen, _ = struct.unpack_from("<4sIQ", data)
    return msgpack.unpackb(data[16:16 + hlen], raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))


def test_decode_names_the_bad_field():
    data = encode(make_group())
    header = _header_of(data)
    _, hlen, blen = struct.unpack_from("<4sIQ", data)
    body = data[len(data) - blen:]

    def bad(h: dict) -> str:
        with pytest.raises(WireError) as info:
            decode(_frame(h, body))
        return str(info.value)

    assert bad({**header, "schema": 4}).startswith("schema: version 4 is not supported")
    assert bad({**header, "schema": 1}).startswith("schema: version 1 comes from a streamgrpo older than per-token")
    assert bad({k: v for k, v in header.items() if k != "answer"}) == "answer: missing"
    assert bad({**header, "policy_version": "7"}).startswith("policy_version:")
    comps = [dict(c) for c in header["completions"]]
    comps[1]["logprobs"] = comps[0]["token_ids"]
    assert bad({**header, "completions": comps}).startswith("completions[1].logprobs: expected dtype float32")
    vis = [dict(v) for v in header["visuals"]]
    ref = msgpack.unpackb(vis[0]["frames"].data)
    vis[0]["frames"] = msgpack.ExtType(1, msgpack.packb([ref[0], ref[1], blen, ref[3]]))  # points past the body
    assert bad({**header, "visuals": vis}).startswith("visuals[0].frames: array bytes")
    assert "over the limit" in str(pytest.raises(WireError, decode, data, max_bytes=len(data) - 1).value)


def test_token_versions_round_trip_and_default_to_the_group_version():
    g = make_group(g=3)
    g.completions[1].versions = np.array([42, 42, 43, 43, 45, 45], dtype=np.int64)  # two in-flight updates
    out = decode(encode(g))
    assert out.schema == SCHEMA_VERSION == 3
    assert out.completions[0].versions.tolist() == [42] * 5  # not given: every token at policy_version
    assert out.completions[1].versions.dtype == np.int32
    assert out.completions[1].versions.tolist() == [42, 42, 43, 43, 45, 45]
    assert g.nbytes < out.nbytes  # the decoded group carries every completion's versions


def test_default_token_versions_follow_any_integer_policy_version_and_list_ids():
    g = make_group(g=2)
    g.policy_version = np.int64(5)  # a numpy scalar, unboxed by the encoder
    g.completions[0].token_ids = g.completions[0].token_ids.tolist()  # a list, coerced to int32
    out = decode(encode(g))
    assert out.policy_version == 5 and out.completions[0].versions.tolist() == [5] * len(g.completions[0].token_ids)
    g.policy_version = 2**31  # versions travel as int32
    with pytest.raises(WireError, match=r"policy_version: expected an integer in \[0, 2\*\*31 - 1\]"):
        encode(g)


@pytest.mark.parametrize("versions,msg", [
    ([42, 43, 42, 43, 43, 43], "completions[1].versions: token 2 has version 42 after version 43"),
    ([41, 42, 42, 42, 42, 42], "completions[1].versions: token version 41 is older than the group's policy_version 42"),
    ([42, 42], "completions[1].versions: 2 values but token_ids has 6"),
])
def test_bad_token_versions_are_named(versions, msg):
    g = make_group(g=3)
    g.completions[1].versions = np.array(versions, dtype=np.int32)
    with pytest.raises(WireError) as info:
        encode(g)
    assert str(info.value).startswith(msg)
    ok = make_group(g=3)  # the same bytes arriving from elsewhere: decode says the same
    ok.completions[1].versions = np.full(6, 50, dtype=np.int32)
    data = bytearray(encode(ok))
    needle = np.full(6, 50, dtype=np.int32).tobytes()
    at = bytes(data).index(needle)
    if len(versions) == 6:
        data[at:at + 24] = np.array(versions, dtype=np.int32).tobytes()
        with pytest.raises(WireError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            decode(bytes(data))


def test_size_limit_on_encode():
    g = make_group()
    size = len(encode(g))
    with pytest.raises(WireError, match="over the limit"):
        encode(g, max_bytes=size - 1)
    assert len(encode(g, max_bytes=size)) == size


# ------------------------------------------------------------------------------------ fuzzing
_VALID = encode(make_group(n_videos=1, g=2))
_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_wire_error(data) -> None:
    try:
        out = decode(data)
    except WireError:
        return
    assert isinstance(out, ScoredGroup)


@_FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_bytes_only_raise_wire_error(data):
    _decode_or_wire_error(data)


@_FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_behind_magic(data):
    _decode_or_wire_error(MAGIC + data)
    _decode_or_wire_error(struct.pack("<4sIQ", MAGIC, len(data), 0) + data)


@_FUZZ
@given(st.integers(min_value=0, max_value=len(_VALID) - 1))
def test_fuzz_truncated_message_raises_wire_error(n):
    with pytest.raises(WireError):
        decode(_VALID[:n])


@_FUZZ
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_corrupted_bytes_decode_or_raise_wire_error(flips):
    data = bytearray(_VALID)
    for pos, value in flips:
        data[pos] = value
    _decode_or_wire_error(bytes(data))


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@_FUZZ
@given(st.dictionaries(st.sampled_from(list(_header_of(_VALID))), _msgpack_values, max_size=14), st.binary(max_size=64))
def test_fuzz_structured_headers_raise_wire_error(replaced, body):
    header = {**_header_of(_VALID), **replaced}
    header["schema"] = replaced.get("schema", SCHEMA_VERSION)
    _decode_or_wire_error(_frame(header, body))


@_FUZZ
@given(st.text(max_size=8), st.lists(st.integers(-3, 2**40), max_size=5), st.integers(-5, 2**40), st.integers(-5, 2**40))
def test_fuzz_array_references_raise_wire_error(dtype, shape, offset, nbytes):
    header = _header_of(_VALID)
    header["prompt_ids"] = msgpack.ExtType(1, msgpack.packb([dtype, shape, offset, nbytes]))
    _decode_or_wire_error(_frame(header, bytes(64)))


def test_non_bytes_input_raises_wire_error():
    for x in (None, "SGRP", 123, [1, 2]):
        with pytest.raises(WireError, match="message: expected bytes"):
            decode(x)


def test_validate_names_the_first_bad_completion_of_several():
    """Values are checked over all completions at once; a failure still names the first bad one."""
    g = make_group(g=4)
    g.completions[3].logprobs[0] = np.nan
    g.completions[1].token_ids[2] = -5
    with pytest.raises(WireError, match=r"^completions\[1\]\.token_ids: negative token id -5"):
        encode(g)
    g.completions[1].token_ids[2] = 5
    with pytest.raises(WireError, match=r"^completions\[3\]\.logprobs: behaviour log-prob .*nan.* at token 0 is not finite"):
        encode(g)
    g.completions[3].logprobs[0] = -1.0
    assert decode(encode(g)).completions[3].logprobs[0] == -1.0


@pytest.mark.parametrize("value", [-3e38, -1001.0, 0.5, 1e30])
def test_a_behaviour_log_prob_no_sampler_can_produce_is_refused(value):
    """Finite but impossible: a log-probability above 0, or below what a float64 sampler can reach;
    one such value made every gradient of its step NaN."""
    g = make_group(g=4)
    g.completions[2].logprobs[3] = value
    with pytest.raises(WireError, match=r"^completions\[2\]\.logprobs: behaviour log-prob .* at token 3 is outside what a "
                                        r"sampler can produce"):
        encode(g)
    for ok in (-999.0, -100.0, 0.0, 1e-4):  # the edges a real sampler (or its rounding) can give
        g.completions[2].logprobs[3] = ok
        assert decode(encode(g)).completions[2].logprobs[3] == np.float32(ok)


# ------------------------------------------------------------------------- visuals by reference (schema 3)
def _by_reference(g: ScoredGroup, algorithm: str = "xxh3_128") -> ScoredGroup:
    from dataclasses import replace

    from streamgrpo.wire import MediaRef
    from streamgrpo.wire.media import frames_digest

    return replace(g, visuals=[replace(v, ref=MediaRef(f"clips/{i}.mp4", v.frames.shape[1], v.frames.shape[2],
                                                       frames_digest(v.frames, algorithm), "auto"))
                               for i, v in enumerate(g.visuals)])


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256", "blake2b"])
def test_reference_visuals_round_trip_without_pixels(algorithm):
    from streamgrpo.wire import inline
    from streamgrpo.wire.media import digest_matches

    g = make_group()
    ref = _by_reference(g, algorithm)
    data = encode(ref)
    assert len(data) < len(encode(g)) - sum(v.frames.nbytes for v in g.visuals) + 2048
    out = decode(data)
    assert out.schema == 3
    for v, w in zip(out.visuals, g.visuals):
        assert v.frames is None and v.ref == _by_reference(g, algorithm).visuals[out.visuals.index(v)].ref
        assert v.nframes == w.frames.shape[0] and v.pixel_bytes == w.frames.nbytes
        assert digest_matches(w.frames, v.ref.digest)
        assert not digest_matches(w.frames[::-1], v.ref.digest) or w.frames.shape[0] == 1
    assert_same_array(out.visuals[0].frame_indices, g.visuals[0].frame_indices)
    back = decode(encode(inline(ref)))  # the same group with its pixels: exactly the inline message
    assert all(v.ref is None and v.frames is not None for v in back.visuals)
    assert encode(inline(ref))[:4] == MAGIC and decode(encode(out)).visuals[0].ref == out.visuals[0].ref


def test_reference_visuals_are_validated_field_by_field():
    from dataclasses import replace

    ref = _by_reference(make_group(n_videos=1))
    data = encode(ref)
    header = _header_of(data)
    _, hlen, blen = struct.unpack_from("<4sIQ", data)
    body = data[len(data) - blen:]

    def bad(visual: dict, schema: int = 3, i: int = 0, body_extra: bytes = b"") -> str:
        vis = [dict(v) for v in header["visuals"]]
        vis[i] = visual
        with pytest.raises(WireError) as info:
            decode(_frame({**header, "schema": schema, "visuals": vis}, body_extra + body[len(body_extra):]
                          if len(body_extra) <= len(body) else body_extra))
        return str(info.value)

    v0, img = header["visuals"][0], header["visuals"][1]
    r0 = v0["ref"]
    assert bad(v0, schema=2).startswith("visuals[0].ref: visuals by reference need schema 3")
    assert bad({**v0, "ref": {**r0, "digest": "md5:00"}}).startswith("visuals[0].ref.digest: algorithm 'md5'")
    assert bad({**v0, "ref": {**r0, "digest": "xxh3_128:abc"}}).startswith("visuals[0].ref.digest: xxh3_128 has 32")
    assert bad({**v0, "ref": {**r0, "digest": "nohex"}}).startswith("visuals[0].ref.digest: expected '<algorithm>:")
    assert bad({**v0, "ref": {**r0, "height": 0}}).startswith("visuals[0].ref.height: expected an integer")
    assert bad({**v0, "ref": {**r0, "path": ""}}).startswith("visuals[0].ref.path: expected a non-empty string")
    assert bad({**v0, "ref": {**r0, "decoder": "ffmpeg"}}).startswith("visuals[0].ref.decoder: 'ffmpeg' is not one of")
    assert bad({k: x for k, x in {**v0, "ref": {k: x for k, x in r0.items() if k != "width"}}.items()}) \
        .startswith("visuals[0].ref.width: missing")
    assert bad({**v0, "frames": img["ref"]}).startswith("visuals[0]: has both frames and a ref")
    empty = msgpack.ExtType(1, msgpack.packb(["int32", [0], 0, 0]))
    assert bad({**v0, "frame_indices": empty}).startswith("visuals[0].frame_indices: a video by reference needs")
    assert bad({**img, "frame_indices": v0["frame_indices"]}, i=1).startswith("visuals[1].frame_indices: an image has no")
    many = msgpack.ExtType(1, msgpack.packb(["int32", [4097], 0, 4097 * 4]))
    assert bad({**v0, "frame_indices": many}, body_extra=bytes(4097 * 4)).startswith(
        "visuals[0].frame_indices: 4097 frames by reference, over the 4096")
    # what references expand to counts against the message limit (what the message could hold inline)
    huge = replace(ref, visuals=[replace(ref.visuals[0], frames=None,
                                         ref=replace(ref.visuals[0].ref, height=60000, width=60000))])
    with pytest.raises(WireError, match=r"visuals\[0\].frames: 28 x 56 frames but the ref says 60000 x 60000"):
        encode(replace(huge, visuals=[replace(huge.visuals[0], frames=ref.visuals[0].frames)]))
    with pytest.raises(WireError, match="visuals: references expand to"):
        decode(encode(huge), max_bytes=256 << 20)
    with pytest.raises(WireError, match=r"visuals\[0\].frames: missing"):
        encode(replace(ref, visuals=[replace(ref.visuals[0], frames=None, ref=None)]))
