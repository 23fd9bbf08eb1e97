"""Lossless weight deltas at Qwen2.5-VL-3B's real layer shapes after a real AdamW step at lr 1e-6.

Builds a random-weight Qwen2.5-VL with the 3B model's layer sizes (hidden 2048, MLP 11008, 16/2 heads,
the 151,936-token tied embedding, vision blocks of 1280) but ``--layers`` decoder layers and
``--vision-blocks`` vision blocks (all of it on this machine would not fit an optimizer), float32
master weights initialised as transformers does (normal, std 0.02), and takes AdamW steps (lr 1e-6,
betas 0.9/0.99, weight decay 0.01: the 3B config's) on the real language-model loss of random tokens.
The bf16 versions after two consecutive steps are the two payloads.

* ``delta_bytes_ratio``: delta bytes / full version bytes (goal <= 1/20 = 0.05); ``changed_words``: the
  share of 16-bit words that changed.
* ``delta_encode_s`` / ``delta_apply_s``: the pure functions alone (encode on the publisher's hash pool).
* ``delta_version_s``: publish() -> a subscriber's poll() returned the version, verified, and its tensors
  copied into a model-shaped set (apply), through the real channel (TCP loopback, this process): as a
  delta (encode, send, apply, full digests checked); baseline the same version sent whole. Goal: ratio <= 1.
* exactness: the delta subscriber's tensors equal the published ones bit for bit (checked, not timed).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_delta [--layers 2] [--vision-blocks 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from benchmarks.common import emit, figure, machine_info, write_result


def _model(layers: int, vision_blocks: int):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from streamgrpo.models.tiny import _model_config, _train_tokenizer

    cfg = _model_config("qwen2_5_vl", _train_tokenizer(), "3b")
    cfg.text_config.num_hidden_layers = layers
    cfg.vision_config.depth = vision_blocks
    cfg.vision_config.fullatt_block_indexes = [vision_blocks - 1]
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg).float(), cfg


def _versions(layers: int, vision_blocks: int, seq: int):
    """Two consecutive bf16 versions (dicts of CPU tensors) and the parameter count."""
    import torch

    net, cfg = _model(layers, vision_blocks)
    params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.01)
    g = torch.Generator().manual_seed(1)

    def step() -> float:
        ids = torch.randint(0, cfg.text_config.vocab_size, (1, seq), generator=g)
        t0 = time.perf_counter()
        loss = net(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    def export() -> dict:
        return {n: p.detach().to(torch.bfloat16).clone() for n, p in net.named_parameters()}

    steps = [step()]  # Adam's moments hold a step: the next one is typical
    prev = export()
    steps.append(step())
    cur = export()
    net = opt = None  # freed before the channel runs
    gc.collect()
    return prev, cur, params, steps


def _payloads(prev: dict, cur: dict):
    import torch

    from streamgrpo.transport.weights.layout import pack_into, plan_layout, specs_of

    layout = plan_layout(specs_of(prev))
    out = []
    for t in (prev, cur):
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack_into(buf, t, layout)
        out.append(buf.numpy())
    return out


def _channel_seconds(prev: dict, cur: dict, delta: bool, repeats: int, check: bool) -> list[float]:
    """publish(cur) -> poll() returned it and its tensors were copied out, after prev went through."""
    import torch

    from streamgrpo.transport.weights.publisher import WeightPublisher
    from streamgrpo.transport.weights.subscriber import WeightSubscriber

    pub = WeightPublisher("127.0.0.1", 0, 0, delta_max_ratio=0.5 if delta else None)
    sub = WeightSubscriber("127.0.0.1", pub.pub_port, pub.snapshot_port, delta=delta)
    model = {n: torch.empty_like(t) for n, t in cur.items()}
    times, version = [], 0
    try:
        for r in range(repeats + 1):  # round 0 warms the buffers
            for tensors, timed in ((prev, False), (cur, True)):
                t0 = time.perf_counter()
                pub.publish(version, tensors)
                while True:
                    got = sub.poll(30.0)
                    if got is None:
                        raise RuntimeError(f"no version {version} after 30 s: {sub.status()} {sub.stats}")
                    if got[0] == version:
                        break
                for n, t in got[1].items():
                    model[n].copy_(t)
                sub.mark_applied()
                if timed and r > 0:
                    times.append(time.perf_counter() - t0)
                    if check and not all(torch.equal(model[n], cur[n]) for n in cur):
                        raise AssertionError("the delta subscriber's tensors differ from the published ones")
                version += 1
        if delta and sub.stats["from_delta"] < repeats:
            raise RuntimeError(f"versions did not travel as deltas: {sub.stats}")
    finally:
        sub.close()
        pub.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vision-blocks", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256, help="tokens in the training step's sequence")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import numpy as np

    from streamgrpo.transport.weights.codec import default_hash_threads
    from streamgrpo.transport.weights.delta import apply_delta, delta_size, encode_delta

    prev, cur, params, step_s = _versions(args.layers, args.vision_blocks, args.seq)
    a, b = _payloads(prev, cur)
    from concurrent.futures import ThreadPoolExecutor

    enc, app = [], []
    with ThreadPoolExecutor(default_hash_threads()) as pool:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            raw = encode_delta(a, b, executor=pool)
            enc.append(time.perf_counter() - t0)
            base = a.copy()
            t0 = time.perf_counter()
            apply_delta(base, raw)
            app.append(time.perf_counter() - t0)
            assert np.array_equal(base, b), "delta round trip not exact"
            del base
    nbytes, changed = delta_size(raw)
    print(f"# {params / 1e6:.0f}M parameters ({args.layers} decoder layers of Qwen2.5-VL-3B, {args.vision_blocks} "
          f"vision blocks, tied 151936 x 2048 embedding); version {nbytes / 1e9:.3f} GB bf16; training steps "
          f"{step_s[0]:.1f} s, {step_s[1]:.1f} s")
    figs = [
        emit(figure("delta_bytes_ratio", len(raw), nbytes, unit="bytes",
                    note="delta / full bf16 version after one AdamW step at lr 1e-6 (goal <= 0.05)")),
        emit(figure("changed_words", changed, nbytes // 2, unit="words", note="16-bit words that changed")),
        emit(figure("delta_encode_s", statistics.median(enc), None, unit="s")),
        emit(figure("delta_apply_s", statistics.median(app), None, unit="s")),
    ]
    del a, b, raw
    gc.collect()
    full = _channel_seconds(prev, cur, delta=False, repeats=args.repeats, check=False)
    gc.collect()
    dlt = _channel_seconds(prev, cur, delta=True, repeats=args.repeats, check=True)
    figs.append(emit(figure("delta_version_s", statistics.median(dlt), statistics.median(full), unit="s",
                            note="publish -> verified and applied, TCP loopback: as a delta vs whole (goal <= 1)")))
    write_result("bench_delta", figs, machine_info(), vars(args),
                 data={"params": params, "version_bytes": nbytes, "delta_runs_s": dlt, "full_runs_s": full})


if __name__ == "__main__":
    main()
