"""A generator written without streamgrpo: the reference client of docs/protocol.md.

It imports nothing from streamgrpo, only redis-py, msgpack, numpy, pyzmq, safetensors, torch and
transformers (and xxhash when the learner uses the default `weights.digest: xxh3_128`). It reads
image questions (LLaVA-style JSONL: `image`, `conversations`), samples G completions per question
with a transformers model at temperature T, scores them, and appends each group to the learner's
Redis stream as a ScoredGroup message (schema 3, frames inline). Between groups it watches the
learner's heartbeat and, when a newer weight version is announced, fetches it from the snapshot
endpoint, checks every chunk's digest and loads it into its model. Replace `sample` with a call to
your own inference server (SGLang, TGI, an API returning token ids and log-probs): the rest stays.

    python examples/producer_client.py --redis redis://127.0.0.1:6379/0 --model Qwen/Qwen2.5-VL-3B-Instruct \
        --records data/images.jsonl --learner 127.0.0.1 --pub-port 5555 --snapshot-port 5556 --groups 100
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import redis
import torch
import zmq
from PIL import Image
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForImageTextToText, AutoProcessor

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


# ------------------------------------------------------------------------------- the message
def encode_message(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """``b"SGRP" u32 header_len u64 body_len header pad body``; ``header`` holds ``("array", key)``
    placeholders that become ext-type-1 references to ``arrays[key]``, each 8-byte aligned."""
    body, offsets = bytearray(), {}
    for key, a in arrays.items():
        body += bytes(-len(body) % 8)
        offsets[key] = len(body)
        body += np.ascontiguousarray(a).tobytes()

    def ref(x):
        if isinstance(x, tuple) and x[0] == "array":
            a = arrays[x[1]]
            return msgpack.ExtType(1, msgpack.packb([str(a.dtype), list(a.shape), offsets[x[1]], a.nbytes]))
        if isinstance(x, dict):
            return {k: ref(v) for k, v in x.items()}
        if isinstance(x, list):
            return [ref(v) for v in x]
        return x

    head = msgpack.packb(ref(header), use_bin_type=True)
    pad = bytes(-(16 + len(head)) % 8)
    return b"SGRP" + struct.pack("<IQ", len(head), len(body)) + head + pad + bytes(body)


def put_group(r: redis.Redis, namespace: str, group_id: str, message: bytes, max_pending: int) -> str:
    """XADD under backpressure: wait while the groups no learner holds reach ``max_pending``."""
    stream, held = f"{namespace}:groups", f"{namespace}:held"
    try:
        r.xgroup_create(stream, "learner", id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    while r.xlen(stream) - r.hlen(held) >= max_pending:
        time.sleep(0.1)
    return r.xadd(stream, {"g": group_id, "d": message}).decode()


# ------------------------------------------------------------------------------- sampling
def prepare(processor, record: dict, root: Path, question_suffix: str):
    """(prompt text, frames uint8 1 x H x W x 3, processor inputs): the image resized to multiples of
    the patch grid, then processed without resizing, exactly as the learner will re-process it."""
    ip = processor.image_processor
    factor = int(ip.patch_size) * int(ip.merge_size)
    img = np.asarray(Image.open(root / record["image"]).convert("RGB"))
    h, w = (max(factor, round(s / factor) * factor) for s in img.shape[:2])
    if (h, w) != img.shape[:2]:
        img = np.asarray(Image.fromarray(img).resize((w, h), Image.BICUBIC))
    question = record["conversations"][0]["value"].replace("<image>", "").strip()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{question} {question_suffix}"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[img], images_kwargs={"do_resize": False}, return_tensors="pt")
    return text, img[None], inputs


@torch.no_grad()
def sample(model, processor, inputs, g: int, temperature: float, max_tokens: int):
    """G completions: (token ids, behaviour log-probs at ``temperature``, text, finish reason) each.
    Plain temperature sampling over the whole vocabulary except the vision placeholders (the learner
    leaves those out of its softmax too): no top-k/top-p, no repetition penalty."""
    tok = processor.tokenizer
    vocab = tok.get_vocab()
    stop = sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id} - {None})
    out = model.generate(**inputs, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         repetition_penalty=1.0, num_return_sequences=g, max_new_tokens=max_tokens,
                         suppress_tokens=[vocab[t] for t in VISION_TOKENS if t in vocab], eos_token_id=stop,
                         pad_token_id=tok.pad_token_id or stop[0], output_scores=True, return_dict_in_generate=True)
    new = out.sequences[:, inputs["input_ids"].shape[1]:]
    logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # scores: after temperature
    chosen = logp.gather(-1, new[:, :logp.shape[1]].unsqueeze(-1)).squeeze(-1)
    result = []
    for row in range(g):
        ids = new[row].tolist()
        n = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
        result.append((np.array(ids[:n], np.int32), chosen[row, :n].numpy().astype(np.float32),
                       tok.decode(ids[:n], skip_special_tokens=True), "stop" if ids[n - 1] in stop else "length"))
    return result


def score(text: str, answer: str) -> float:
    """Accuracy: the answer's option letter, e.g. "(A)", in the text."""
    letter = answer.split(")")[0] + ")" if answer.startswith("(") else answer
    return float(letter in text)


# ------------------------------------------------------------------------------- weights
def _digest(algo: str, data: bytes) -> bytes:
    if algo == "sha256":
        return hashlib.sha256(data).digest()
    import xxhash

    return xxhash.xxh3_128(data).digest()


class Weights:
    """Heartbeats on the PUB socket; versions fetched chunk by chunk from the snapshot endpoint."""

    def __init__(self, host: str, pub_port: int, snapshot_port: int):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"h")
        self.sub.connect(f"tcp://{host}:{pub_port}")
        self.snap = self.ctx.socket(zmq.DEALER)
        self.snap.connect(f"tcp://{host}:{snapshot_port}")
        self.have: tuple[int, int] | None = None  # (src, version)
        self.rid = 0

    def newer(self) -> tuple[int, int] | None:
        """The newest (src, version) a heartbeat announced that we do not hold, or None."""
        best = None
        while self.sub.poll(0):
            _topic, body = self.sub.recv_multipart()
            beat = msgpack.unpackb(body)
            key = (beat["s"], beat["v"])
            if self.have is None or key[0] != self.have[0] or key[1] > self.have[1]:
                best = key
        return best

    def _request(self, version: int, seq: int) -> list[bytes]:
        self.rid += 1
        self.snap.send_multipart([b"snap", msgpack.packb({"r": self.rid, "v": version, "q": seq})])
        while True:
            if not self.snap.poll(10_000):
                raise TimeoutError("no reply from the snapshot endpoint in 10 s")
            reply = self.snap.recv_multipart()
            if msgpack.unpackb(reply[1]).get("r") == self.rid:
                return reply

    def fetch(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The learner's latest version, every chunk digest-checked; None if it has none or it moved on."""
        reply = self._request(-1, 0)
        if reply[0] != b"w":
            return None
        head = msgpack.unpackb(reply[1])
        meta_bytes = head["m"]
        meta = msgpack.unpackb(meta_bytes)
        if meta["fmt"] != 2:
            raise ValueError(f"weights format {meta['fmt']} is not 2")
        payload = bytearray(meta["nbytes"])
        for seq in range(meta["n"]):
            if seq:
                reply = self._request(meta["version"], seq)
                if reply[0] != b"w":
                    return None  # a newer version replaced it: the next heartbeat says so
                head = msgpack.unpackb(reply[1])
            chunk = reply[2]
            if head["q"] != seq or head["o"] != seq * meta["chunk"] or len(chunk) != head["l"]:
                raise ValueError(f"weights v{meta['version']}: chunk {seq} out of place")
            if _digest(meta["algo"], (meta_bytes if seq == 0 else b"") + chunk) != head["d"]:
                raise ValueError(f"weights v{meta['version']}: digest mismatch in chunk {seq}")
            payload[head["o"]:head["o"] + head["l"]] = chunk
        self.have = (meta["src"], meta["version"])
        return meta["version"], load_safetensors(bytes(payload))  # the payload is a safetensors file

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@torch.no_grad()
def apply(model, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n in tensors if n not in params]
    if missing:
        raise KeyError(f"the learner sent tensors this model does not have: {missing[:3]}")
    for name, t in tensors.items():
        params[name].copy_(t.to(params[name].dtype))


# ------------------------------------------------------------------------------- the loop
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis", required=True)
    ap.add_argument("--namespace", default="streamgrpo")
    ap.add_argument("--model", required=True)
    ap.add_argument("--records", required=True, help="JSONL of image questions (image path relative to the file)")
    ap.add_argument("--learner", default="127.0.0.1", help="host of the learner's weight ports")
    ap.add_argument("--pub-port", type=int, default=5555)
    ap.add_argument("--snapshot-port", type=int, default=5556)
    ap.add_argument("--groups", type=int, default=8, help="groups to put (then stop)")
    ap.add_argument("--until-version", type=int, default=0, help="also wait until this weight version is applied")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-pending", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    processor = AutoProcessor.from_pretrained(a.model)
    model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.float32).eval()
    path = Path(a.records)
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    r = redis.Redis.from_url(a.redis)
    weights = Weights(a.learner, a.pub_port, a.snapshot_port)
    version, put, deadline = 0, 0, time.monotonic() + a.timeout_s
    try:
        while (put < a.groups or version < a.until_version) and time.monotonic() < deadline:
            if weights.newer() is not None or (weights.have is None and put == 0):
                got = weights.fetch()
                if got is not None:
                    version, tensors = got
                    apply(model, tensors)
                    print(f"applied weights v{version} ({len(tensors)} tensors)", flush=True)
            if put >= a.groups:
                time.sleep(0.2)
                continue
            rec = records[put % len(records)]
            answer = rec["conversations"][1]["value"].split("<answer>")[-1].split("</answer>")[0].strip()
            text, frames, inputs = prepare(processor, rec, path.parent, "Answer with the option letter.")
            completions = sample(model, processor, inputs, a.num_generations, a.temperature, a.max_tokens)
            group_id = uuid.uuid4().hex
            arrays = {"prompt_ids": inputs["input_ids"][0].numpy().astype(np.int32), "frames": frames,
                      "indices": np.zeros(0, np.int32)}
            comps = []
            for i, (ids, lps, ctext, reason) in enumerate(completions):
                arrays[f"ids{i}"], arrays[f"lp{i}"] = ids, lps
                arrays[f"v{i}"] = np.full(len(ids), version, np.int32)
                acc = score(ctext, answer)
                comps.append({"token_ids": ("array", f"ids{i}"), "logprobs": ("array", f"lp{i}"),
                              "versions": ("array", f"v{i}"), "text": ctext, "finish_reason": reason,
                              "rewards": {"accuracy": acc}, "reward": acc})
            header = {"schema": 3, "group_id": group_id, "prompt_id": str(rec.get("id", put)), "generator_id":
                      "reference-client", "policy_version": version, "created_at": time.time(), "model_id": a.model,
                      "prompt_ids": ("array", "prompt_ids"), "answer": answer, "prompt_text": text,
                      "visuals": [{"kind": "image", "frames": ("array", "frames"), "fps": 0.0,
                                   "frame_indices": ("array", "indices")}],
                      "completions": comps, "meta": {"kind": "image", "temperature": a.temperature}}
            sid = put_group(r, a.namespace, group_id, encode_message(header, arrays), a.max_pending)
            put += 1
            print(f"put group {group_id} as {sid} (v{version})", flush=True)
    finally:
        weights.close()
    done = put >= a.groups and version >= a.until_version
    print(f"{put} group(s) put, weights v{version}" + ("" if done else ": timed out"), flush=True)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
