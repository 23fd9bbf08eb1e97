"""Pure logic of the weight channel: safetensors layout, headers, chunk digests, assembly, applying, LoRA merge, keys."""

from __future__ import annotations

import json
import os
import stat
import struct
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from weights_reference import build_version, iter_chunks

from streamgrpo.models.apply import WeightsApplyError, apply_to_model
from streamgrpo.models.lora import LoraApplier, filter_lora, merge_lora_into
from streamgrpo.transport.weights.codec import (
    Assembler,
    ChunkHeader,
    WeightsFormatError,
    decode_header,
    decode_meta,
    encode_header,
    encode_meta,
    key_of,
    newer,
    select_chunks,
)
from streamgrpo.transport.weights.layout import (
    ALIGN,
    LayoutMemo,
    parse_layout,
    plan_layout,
    specs_of,
    unpack_tensors,
)


def _bits(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor (bit-exact comparison, NaN payloads included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(7, 13, generator=g),
        "bf16": torch.randn(3, 5, 11, generator=g).to(torch.bfloat16),
        "f16": torch.randn(257, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "i8": torch.randint(-128, 127, (4, 4), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (33,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "noncontig": torch.randn(6, 4, generator=g).t(),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def _chunks(version, tensors, chunk_bytes=64, src=7):
    meta, meta_bytes, buf = build_version(version, tensors, chunk_bytes, src=src, published_at=123.0)
    return [(h, bytes(p)) for h, p in iter_chunks(meta, meta_bytes, buf)]


def _assembler(released=None, executor=None):
    return Assembler(lambda n: torch.empty(n, dtype=torch.uint8), (released.append if released is not None else None),
                     executor)


def _feed_all(asm, chunks):
    results = [asm.feed(h, p) for h, p in chunks]
    done = [d for d, _ in results if d is not None]
    drops = [w for _, w in results if w]
    return done, drops


# ------------------------------------------------------------------------------------ layout
def test_layout_is_a_safetensors_image_aligned_with_tied_weights_once():
    w = torch.randn(10, 3)
    tensors = {"embed.weight": w, "odd": torch.zeros(5, dtype=torch.int8), "lm_head.weight": w, "x": torch.ones(2)}
    layout = plan_layout(specs_of(tensors))
    by = {e.name: e for e in layout.entries}
    header = len(layout.header)
    assert header % ALIGN == 0  # the data section starts 64-byte aligned
    assert all(e.offset % torch.empty((), dtype=v.dtype).element_size() == 0 for e, v in zip(layout.entries, tensors.values()))
    assert by["embed.weight"].offset == by["lm_head.weight"].offset  # tied: bytes travel once
    assert layout.nbytes == header + 120 + 8 + 5  # largest items first, no padding between tensors
    buf = build_version(1, tensors, 64)[2]
    out = unpack_tensors(buf, parse_layout(buf))
    assert all(torch.equal(out[k], v) for k, v in tensors.items())
    opened = safetensors.torch.load(bytes(buf.numpy()))  # the payload is a safetensors file as it is
    assert sorted(opened) == ["embed.weight", "odd", "x"] and torch.equal(opened["embed.weight"], w)


def test_layout_memo_replans_only_when_a_spec_changes():
    memo = LayoutMemo()
    w = {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(5)}
    first = memo(specs_of(w))
    assert memo(specs_of(w)) is first  # same names, shapes, dtypes, storages: no new plan
    w["b.bias"] = torch.zeros(6)  # a new shape (and storage)
    second = memo(specs_of(w))
    assert second is not first and second == plan_layout(specs_of(w))
    assert [e.shape for e in second.entries] == [(4, 3), (6,)]
    w["b.bias"] = w["a.weight"]  # now tied: the alias must be planned, not the old entry reused
    assert len(memo(specs_of(w)).data) == 1


def test_export_dtype_casts_floating_tensors_only():
    tensors = {"w": torch.randn(4, 4), "steps": torch.arange(3), "h": torch.randn(2).half()}
    buf = build_version(1, tensors, 64, dtype=torch.bfloat16)[2]
    out = unpack_tensors(buf, parse_layout(buf))
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], tensors["w"].to(torch.bfloat16))
    assert out["h"].dtype == torch.bfloat16 and out["steps"].dtype == torch.int64
    assert len(buf) < len(build_version(1, tensors, 64)[2])  # half the bytes of the fp32 master copy


def test_layout_rejects_unsupported_dtype_naming_the_tensor():
    with pytest.raises(TypeError, match="'z'.*complex128"):
        specs_of({"a": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)})


def _payload(table: dict, data: bytes) -> bytes:
    text = json.dumps(table).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("table,data,msg", [
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "do not match shape"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}, bytes(8), "outside"),
    ({"a": {"dtype": "Q9", "shape": [3], "data_offsets": [0, 12]}}, bytes(12), "dtype"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}, bytes(6), "gap or overlap"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, bytes(5), "payload has"),
    ({"__metadata__": {"streamgrpo.aliases": '{"b": "zz"}'}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
     bytes(1), "alias"),
])
def test_tensor_table_validation_names_the_problem(table, data, msg):
    with pytest.raises(WeightsFormatError, match=msg):
        parse_layout(_payload(table, data))
    with pytest.raises(WeightsFormatError, match="not JSON"):
        parse_layout(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(WeightsFormatError, match="runs past"):
        parse_layout(struct.pack("<Q", 99) + b"{}")


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.int8,
           torch.uint8, torch.bool]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 6), max_size=3)), min_size=1, max_size=6),
       st.integers(1, 200))
def test_pack_unpack_round_trip_is_bit_exact(specs, chunk_bytes):
    g = torch.Generator().manual_seed(len(specs))
    tensors = {}
    for i, (dtype, shape) in enumerate(specs):
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size(),),
                            generator=g, dtype=torch.uint8)
        tensors[f"t{i}"] = raw.view(dtype).reshape(shape) if dtype != torch.bool else (raw % 2).view(torch.bool).reshape(shape)
    done, drops = _feed_all(_assembler(), _chunks(3, tensors, chunk_bytes))
    assert drops == [] and len(done) == 1
    out = done[0].tensors()
    assert list(out) == list(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and _bits(out[k]) == _bits(v)


# -------------------------------------------------------------------------------- meta/header
def test_meta_round_trip_and_validation():
    meta, meta_bytes, _ = build_version(5, {"a": torch.ones(3, 3)}, 16, src=9, published_at=1.5)
    assert decode_meta(meta_bytes) == meta == decode_meta(encode_meta(meta))
    d = msgpack.unpackb(meta_bytes)
    bad = [
        ({"algo": "md5"}, "digest algorithm"),
        ({"n": 99}, "n_chunks"),
        ({"version": -1}, "'version'"),
        ({"ts": "noon"}, "publish time"),
        ({"fmt": 1}, "format"),
    ]
    for patch, msg in bad:
        with pytest.raises(WeightsFormatError, match=msg):
            decode_meta(msgpack.packb({**d, **patch}))
    with pytest.raises(WeightsFormatError, match="not msgpack"):
        decode_meta(b"\xc1garbage")


def test_header_round_trip_and_validation():
    h = ChunkHeader(3, 4, 0, 2, 0, 10, digest=b"d", meta=b"m", req=8)
    assert decode_header(encode_header(h)) == h
    for d, msg in [
        ({"v": 1, "s": 0, "q": 2, "n": 2, "o": 0, "l": 1, "d": b"x"}, "seq 2 >= n_chunks"),
        ({"v": 1, "s": 0, "q": 0, "n": 2, "o": 0, "l": 1, "d": b"x"}, "meta must travel with chunk 0"),
        ({"v": 1, "s": 0, "q": 1, "n": 2, "o": 0, "l": 1}, "no chunk digest"),
        ({"v": "1", "s": 0, "q": 0, "n": 1, "o": 0, "l": 1, "d": b"x", "m": b""}, "'v'"),
    ]:
        with pytest.raises(WeightsFormatError, match=msg):
            decode_header(msgpack.packb(d))
    with pytest.raises(WeightsFormatError):
        decode_header(b"\x93\x01")


def test_newer_orders_by_version_and_treats_a_new_publisher_as_newer():
    assert newer((1, 5), None) and newer((1, 6), (1, 5)) and not newer((1, 5), (1, 5)) and not newer((1, 4), (1, 5))
    assert newer((2, 0), (1, 5))  # restarted learner: new lineage


# ----------------------------------------------------------------------------------- assembly
@pytest.mark.parametrize("threads", [0, 3], ids=["inline", "worker_threads"])
def test_assembler_rebuilds_a_version_and_a_later_one(threads):
    t = _sample_tensors()
    pool = ThreadPoolExecutor(threads) if threads else None
    asm = _assembler(executor=pool)
    chunks = _chunks(1, t) + _chunks(2, {"x": torch.arange(100)})
    assert len(chunks) > 10
    done, drops = _feed_all(asm, chunks)
    assert drops == [] and [d.meta.version for d in done] == [1, 2]
    out = done[0].tensors()
    assert all(_bits(out[k]) == _bits(v) and out[k].shape == v.shape for k, v in t.items())
    assert done[0].meta.published_at == 123.0 and asm.in_progress is None


def test_empty_version_round_trips():
    done, drops = _feed_all(_assembler(), _chunks(4, {}))
    assert drops == [] and done[0].meta.version == 4 and done[0].tensors() == {}


@pytest.mark.parametrize("threads", [0, 2], ids=["inline", "worker_threads"])
@pytest.mark.parametrize("where", [0, 3], ids=["tensor_table", "tensor_bytes"])
def test_flipped_payload_byte_is_rejected_once(where, threads):
    chunks = _chunks(1, _sample_tensors())
    h, p = chunks[where]
    chunks[where] = (h, p[:9] + bytes([p[9] ^ 0x01]) + p[10:])
    released = []
    pool = ThreadPoolExecutor(threads) if threads else None
    done, drops = _feed_all(_assembler(released, pool), chunks)
    assert done == [] and len(drops) == 1 and f"digest mismatch (xxh3_128) in chunk {where}" in drops[0]
    assert len(released) == 1


def test_well_hashed_but_malformed_tensor_table_is_rejected():
    from weights_reference import iter_chunks as chunks_of

    from streamgrpo.transport.weights.codec import VersionMeta

    payload = _payload({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    meta = VersionMeta(1, 7, len(payload), 16, -(-len(payload) // 16), 0.0, "xxh3_128")
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    chunks = [(h, bytes(c)) for h, c in chunks_of(meta, encode_meta(meta), buf)]
    done, drops = _feed_all(_assembler(), chunks)
    assert done == [] and "malformed tensor table" in drops[0] and "do not match shape" in drops[0]


def test_flipped_meta_byte_is_rejected():
    chunks = _chunks(1, {"a": torch.ones(40)})
    h, p = chunks[0]
    meta = msgpack.unpackb(h.meta)
    meta["ts"] = 999.0  # still a valid meta record: the chunk-0 digest covers it
    chunks[0] = (ChunkHeader(h.version, h.src, h.seq, h.n_chunks, h.offset, h.size, h.digest, msgpack.packb(meta)), p)
    done, drops = _feed_all(_assembler(), chunks)
    assert done == [] and len(drops) == 1 and "digest mismatch" in drops[0]


def test_missing_chunk_drops_the_version_once_and_the_next_version_still_works():
    chunks = _chunks(1, _sample_tensors())
    del chunks[4]
    done, drops = _feed_all(_assembler(), chunks + _chunks(2, {"y": torch.ones(3)}))
    assert [d.meta.version for d in done] == [2]
    assert len(drops) == 1 and "missing chunks 4..4" in drops[0]


def test_missing_first_chunk_and_truncated_version_are_reported():
    v1, v2 = _chunks(1, _sample_tensors()), _chunks(2, _sample_tensors())
    done, drops = _feed_all(_assembler(), v1[1:] + v2[:5] + _chunks(3, {"z": torch.ones(1)}))
    assert [d.meta.version for d in done] == [3]
    assert "without the start" in drops[0] and "version 2: incomplete (5/" in drops[1] and len(drops) == 2


def test_chunk_of_wrong_size_is_rejected():
    chunks = _chunks(1, {"a": torch.ones(100)})
    h, p = chunks[1]
    chunks[1] = (h, p[:-1])
    done, drops = _feed_all(_assembler(), chunks)
    assert done == [] and "bytes at offset" in drops[0]


def test_select_chunks_skips_superseded_versions():
    v = {n: [h for h, _ in _chunks(n, {"a": torch.ones(40)}, chunk_bytes=72)] for n in (1, 2, 3)}
    assert len(v[1]) == 4
    # complete v1, complete v2, partial v3: keep from v2 (newest complete) on
    batch = v[1] + v[2] + v[3][:2]
    assert select_chunks(batch, None) == list(range(4, 10))
    # only partial versions: keep the last one
    assert select_chunks(v[1][:2] + v[2][:3], None) == [2, 3, 4]
    # the batch finishes the version in progress and starts the next: keep everything
    assert select_chunks(v[1][2:] + v[2][:1], ((7, 1), 2)) == [0, 1, 2]
    # with a gap in the newest "complete-looking" version, fall back to the older complete one
    assert select_chunks(v[1] + [v[2][0], v[2][2], v[2][3]], None) == list(range(0, 7))
    assert key_of(v[1][0]) == (7, 1)


# ----------------------------------------------------------------------------------- applying
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def test_apply_to_model_copies_in_place():
    net, src = _Net(), _Net()
    torch.nn.init.normal_(src.lin.weight)
    src.steps += 5
    ptrs = {k: v.data_ptr() for k, v in net.state_dict().items()}
    n = apply_to_model(net, {k: v.clone() for k, v in src.state_dict().items()}, strict=True)
    assert n == 3
    assert all(torch.equal(net.state_dict()[k], v) for k, v in src.state_dict().items())
    assert {k: v.data_ptr() for k, v in net.state_dict().items()} == ptrs  # no reallocation


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"lin.bias": torch.zeros(4)}, r"'lin.bias' has shape \(4,\)"),
        ({"lin.bias": torch.zeros(3, dtype=torch.float64)}, "'lin.bias' has dtype torch.float64"),
        ({"nope.weight": torch.zeros(1)}, "'nope.weight' is not a parameter"),
    ],
)
def test_apply_to_model_is_all_or_nothing(bad, msg):
    net = _Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    good = {"lin.weight": torch.ones(3, 4), "steps": torch.ones(2, dtype=torch.int64)}
    with pytest.raises(WeightsApplyError, match=msg):
        apply_to_model(net, {**good, **bad})
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())


def test_apply_to_model_strict_and_cast():
    net = _Net()
    with pytest.raises(WeightsApplyError, match="missing"):
        apply_to_model(net, {"lin.weight": torch.ones(3, 4)}, strict=True)
    assert apply_to_model(net, {"lin.bias": torch.ones(3, dtype=torch.float64)}, allow_cast=True) == 1
    assert torch.equal(net.lin.bias, torch.ones(3))


# --------------------------------------------------------------------------------------- LoRA
class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8, bias=False)
        self.v_proj = torch.nn.Linear(8, 6)
        self.o_proj = torch.nn.Linear(6, 8)

    def forward(self, x):
        return self.o_proj(self.v_proj(x)) + self.q_proj(x)


def _peft_pair(seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = _Attn()
    plain = _Attn()
    plain.load_state_dict(base.state_dict())
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    return peft_model, plain


def test_filter_and_merge_match_peft():
    peft_model, plain = _peft_pair()
    adapters = filter_lora(dict(peft_model.state_dict()))
    assert adapters and all("lora_" in k for k in adapters) and len(adapters) == 4
    merged = merge_lora_into(plain.state_dict(), adapters, scale=8 / 4)
    assert set(merged) == {"q_proj.weight", "v_proj.weight"}
    reference = peft_model.merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, reference[k])


def test_lora_applier_does_not_accumulate():
    peft_model, plain = _peft_pair()
    x = torch.randn(5, 8)
    applier = LoraApplier(plain, scale=2.0)
    adapters = {k: v.clone() for k, v in filter_lora(dict(peft_model.state_dict())).items()}
    assert applier.apply(adapters) == 2
    assert applier.apply(adapters) == 2  # same adapter twice: same result, not base + 2 * delta
    with torch.no_grad():
        torch.testing.assert_close(plain(x), peft_model(x))


def test_lora_errors_name_the_tensor():
    _, plain = _peft_pair()
    with pytest.raises(WeightsApplyError, match="q_proj.*lora_A but not its pair"):
        merge_lora_into(plain.state_dict(), {"base_model.model.q_proj.lora_A.default.weight": torch.zeros(4, 8)}, 1.0)
    with pytest.raises(WeightsApplyError, match="lora_embedding_A.*unsupported"):
        merge_lora_into(plain.state_dict(), {"emb.lora_embedding_A.default": torch.zeros(4, 8)}, 1.0)
    with pytest.raises(WeightsApplyError, match="no base weight for adapted module 'k_proj'"):
        merge_lora_into(plain.state_dict(), {"k_proj.lora_A.weight": torch.zeros(4, 8),
                                             "k_proj.lora_B.weight": torch.zeros(8, 4)}, 1.0)


# --------------------------------------------------------------------------------------- keys
def test_generate_keys_layout_modes_and_reuse(tmp_path):
    import zmq.auth

    from streamgrpo.transport.weights.keys import (
        EVALUATOR,
        authorised_dir,
        client_keys,
        generate_keys,
        server_keys,
    )

    old = os.umask(0o022)
    try:
        kf = generate_keys(tmp_path / "k", clients=2)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(kf.server_secret) == 0o600 and mode(kf.server_public) == 0o644
    assert all(mode(sec) == 0o600 and mode(pub) == 0o644 for pub, sec in [*kf.clients, kf.evaluator])
    assert mode(authorised_dir(kf.keys_dir)) == 0o700
    pub, sec = server_keys(kf.keys_dir, secret=True)
    assert len(pub) == 40 and len(sec) == 40
    assert set(zmq.auth.load_certificates(authorised_dir(kf.keys_dir))) == {client_keys(kf.keys_dir, name)[0]
                                                                           for name in ("client-0", "client-1",
                                                                                        EVALUATOR)}
    assert client_keys(kf.keys_dir)[0] == client_keys(kf.keys_dir, "client-0")[0]
    again = generate_keys(tmp_path / "k", clients=3)  # keeps existing pairs, adds one
    assert server_keys(again.keys_dir, secret=False)[0] == pub and len(again.clients) == 3
    assert again.evaluator == kf.evaluator and client_keys(kf.keys_dir, EVALUATOR)[0] == zmq.auth.load_certificate(
        kf.evaluator[0])[0]  # the evaluator's pair, kept
    assert client_keys(kf.keys_dir, "client-1") == client_keys(kf.keys_dir, str(kf.clients[1][1]))
    with pytest.raises(FileNotFoundError, match="client-9"):
        client_keys(kf.keys_dir, "client-9")
    with pytest.raises(FileNotFoundError, match="streamgrpo keys"):
        server_keys(tmp_path / "none", secret=True)


@pytest.mark.parametrize("table", [
    {"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
    {"a": {"dtype": "U8", "shape": [0, 2**70], "data_offsets": [0, 0]}},
    {"__metadata__": {"streamgrpo.aliases": ["x"]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
    {"__metadata__": {"streamgrpo.aliases": '{"b": ["a"]}'}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
])
def test_hostile_tensor_tables_raise_format_errors_only(table):
    with pytest.raises(WeightsFormatError):
        parse_layout(_payload(table, bytes(1 if "__metadata__" in table else 0)))
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(WeightsFormatError):
        parse_layout(struct.pack("<Q", len(deep)) + deep)


def test_version_too_big_to_allocate_is_dropped_with_a_reason():
    def refuse(n):
        raise RuntimeError("out of memory")

    done, drops = _feed_all(Assembler(refuse), _chunks(1, {"a": torch.ones(4)}))
    assert done == [] and "cannot allocate" in drops[0] and len(drops) == 1
