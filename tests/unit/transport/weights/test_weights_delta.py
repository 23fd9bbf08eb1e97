"""Lossless weight deltas (pure): exact round trips on random bf16 payloads and on a real optimizer
step, a delta much smaller than the version after an AdamW step at lr 1e-6, and malformed deltas
refused before the base is touched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgrpo.transport.weights.delta import (
    apply_delta,
    changed_words,
    delta_size,
    encode_delta,
    varint_decode,
    varint_encode,
)
from streamgrpo.transport.weights.layout import WeightsFormatError, pack_into, plan_layout, specs_of


def _payload(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    layout = plan_layout(specs_of(tensors))
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_into(buf, tensors, layout)
    return buf.numpy()


def test_varints_round_trip_at_their_byte_boundaries():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**35, 2**63, 2**64 - 1], np.uint64)
    data = varint_encode(values)
    assert data.size == 1 + 1 + 1 + 2 + 2 + 3 + 3 + 4 + 6 + 10 + 10
    assert np.array_equal(varint_decode(data, values.size), values)
    assert varint_encode(np.array([300], np.uint64)).tolist() == [0xAC, 0x02]  # LEB128 as protobuf writes it


@pytest.mark.parametrize("size, share", [(1, 1.0), (7, 0.5), (4096, 0.0), (100_001, 0.01), (100_000, 1.0)])
def test_round_trip_is_exact_on_random_payloads(size, share):
    rng = np.random.default_rng(size)
    prev = rng.integers(0, 256, size, dtype=np.uint8)
    cur = prev.copy()
    words = cur[: size // 2 * 2].view("<u2")
    hit = rng.random(words.size) < share
    words[hit] = rng.integers(0, 2**16, int(hit.sum()), dtype=np.uint16)
    if size % 2:
        cur[-1] ^= 0x5A
    raw = encode_delta(prev, cur)
    assert delta_size(raw) == (size, int(np.count_nonzero(prev[: size // 2 * 2].view("<u2") != words)))
    base = prev.copy()
    apply_delta(base, raw)
    assert np.array_equal(base, cur)


def test_bf16_tensors_round_trip_bit_for_bit_and_blocks_and_threads_agree():
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(1000, 257, generator=g).to(torch.bfloat16), "b": torch.randn(3, generator=g)}
    b = {"w": a["w"].clone(), "b": a["b"] + 1e-3}
    b["w"][::37] += torch.tensor(0.5, dtype=torch.bfloat16)
    prev, cur = _payload(a), _payload(b)
    one = changed_words(prev, cur)
    with ThreadPoolExecutor(2) as pool:
        assert np.array_equal(changed_words(prev, cur, block=4096, executor=pool), one)
        raw = encode_delta(prev, cur, executor=pool)
    assert np.array_equal(one, np.flatnonzero(prev.view("<u2") != cur.view("<u2")))
    base = prev.copy()
    apply_delta(base, raw)
    assert base.tobytes() == cur.tobytes()


def test_an_adamw_step_at_lr_1e_6_changes_few_bf16_words_and_the_delta_rebuilds_it_exactly():
    """fp32 master weights, a real gradient of a real loss, AdamW at lr 1e-6: the bf16 versions before
    and after differ in ~1% of their words, and the delta is far smaller than the version."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(512, 256), torch.nn.Linear(256, 1024), torch.nn.GELU(),
                              torch.nn.Linear(1024, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 512))
    for p in net.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-6, weight_decay=0.0)

    def step() -> None:
        tokens = torch.randint(0, 512, (8, 32))
        logits = net(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), tokens.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    def version() -> np.ndarray:
        return _payload({n: p.detach().to(torch.bfloat16) for n, p in net.named_parameters()}).copy()

    step()  # Adam's moments hold a step: the next one is a typical one
    prev = version()
    step()
    cur = version()
    raw = encode_delta(prev, cur)
    changed = delta_size(raw)[1] / (prev.size // 2)
    assert 0 < changed < 0.05, changed
    assert len(raw) < prev.size / 20, (len(raw), prev.size)
    base = prev.copy()
    apply_delta(base, raw)
    assert np.array_equal(base, cur)


@pytest.mark.parametrize("break_it, why", [
    (lambda raw: b"XXXX" + raw[4:], "magic"),
    (lambda raw: raw[:-1], "head announces"),
    (lambda raw: raw[:10], "shorter than"),
    (lambda raw: raw[:28] + bytes([0xFF]) * (len(raw) - 28 - 4) + raw[-4:], "varint|position"),
])
def test_malformed_deltas_are_refused_before_the_base_is_touched(break_it, why):
    prev = np.arange(64, dtype=np.uint8)
    cur = prev.copy()
    cur[[3, 40]] = 0
    bad = break_it(encode_delta(prev, cur))
    base = prev.copy()
    with pytest.raises(WeightsFormatError, match=why):
        apply_delta(base, bad)
    assert np.array_equal(base, prev)


def test_positions_past_the_payload_and_other_lengths_are_refused():
    prev = np.zeros(64, np.uint8)
    cur = prev.copy()
    cur[62] = 1
    raw = encode_delta(prev, cur)
    with pytest.raises(WeightsFormatError, match="the base has 62"):
        apply_delta(np.zeros(62, np.uint8), raw)
    far = bytearray(raw)
    far[28] = 40  # the one position: word 40 of a 32-word payload
    with pytest.raises(WeightsFormatError, match="a position gap of 40 words|past the payload"):
        apply_delta(prev.copy(), bytes(far))
    with pytest.raises(ValueError, match="one layout"):
        encode_delta(prev, np.zeros(66, np.uint8))


def test_encoding_stops_past_its_budget_and_small_windows_apply_the_same():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(3)
    prev = rng.integers(0, 256, 1_000_001, dtype=np.uint8)
    cur = rng.integers(0, 256, prev.size, dtype=np.uint8)  # nearly every word changed
    assert encode_delta(prev, cur, max_bytes=prev.size // 2) is None  # not worth it: stopped early
    few = prev.copy()
    few[::1000] ^= 1
    with ThreadPoolExecutor(2) as pool:
        raw = encode_delta(prev, few, executor=pool, max_bytes=prev.size // 2)
    assert raw is not None and raw == encode_delta(prev, few)  # threads change nothing
    base = prev.copy()
    apply_delta(base, raw, window=64)  # positions read 64 bytes at a time
    assert np.array_equal(base, few)
