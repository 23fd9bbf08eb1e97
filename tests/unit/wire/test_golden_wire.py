"""Golden messages: the format cannot drift unseen (docs/protocol.md).

Each ``tests/golden/*.sgrp`` is a message as this release writes (or, for schema 2, as the previous
one wrote) it, beside its decoded content in ``*.json``. Both ways: decoding the bytes gives the JSON,
and encoding the JSON gives the bytes, bit for bit. A change to the format fails here until the
golden files are remade on purpose (``STREAMGRPO_REGEN_GOLDEN=1``) and docs/protocol.md says what
changed.
"""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

from streamgrpo.wire import Completion, MediaRef, ScoredGroup, Visual, decode, encode
from streamgrpo.wire.media import frames_digest
from tests.paths import GOLDEN

GOLDEN = GOLDEN


def _arr(a: np.ndarray) -> dict:
    return {"dtype": str(a.dtype), "shape": list(a.shape), "base64": base64.b64encode(a.tobytes()).decode()}


def _from_arr(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["base64"]), dtype=np.dtype(d["dtype"]).newbyteorder("<")).reshape(d["shape"])


def to_json(g: ScoredGroup) -> dict:
    visuals = []
    for v in g.visuals:
        out = {"kind": v.kind, "fps": v.fps, "frame_indices": _arr(v.frame_indices)}
        if v.ref is not None:
            out["ref"] = {"path": v.ref.path, "height": v.ref.height, "width": v.ref.width, "digest": v.ref.digest,
                          "decoder": v.ref.decoder}
        else:
            out["frames"] = _arr(v.frames)
        visuals.append(out)
    return {
        "schema": g.schema, "group_id": g.group_id, "prompt_id": g.prompt_id, "generator_id": g.generator_id,
        "policy_version": g.policy_version, "created_at": g.created_at, "model_id": g.model_id,
        "prompt_ids": _arr(g.prompt_ids), "answer": g.answer, "prompt_text": g.prompt_text, "visuals": visuals,
        "completions": [{"token_ids": _arr(c.token_ids), "logprobs": _arr(c.logprobs), "versions": _arr(c.versions),
                         "text": c.text, "finish_reason": c.finish_reason, "rewards": c.rewards, "reward": c.reward}
                        for c in g.completions],
        "meta": g.meta,
    }


def from_json(d: dict) -> ScoredGroup:
    visuals = [Visual(v["kind"], _from_arr(v["frames"]) if "frames" in v else None, v["fps"],
                      _from_arr(v["frame_indices"]), MediaRef(**v["ref"]) if "ref" in v else None)
               for v in d["visuals"]]
    completions = [Completion(_from_arr(c["token_ids"]), _from_arr(c["logprobs"]), c["text"], c["finish_reason"],
                              c["rewards"], c["reward"], _from_arr(c["versions"])) for c in d["completions"]]
    return ScoredGroup(d["prompt_id"], d["generator_id"], d["policy_version"], d["model_id"], _from_arr(d["prompt_ids"]),
                       visuals, d["answer"], completions, d["prompt_text"], d["meta"], d["group_id"], d["created_at"],
                       d["schema"])


def _examples() -> dict[str, ScoredGroup]:
    rng = np.random.default_rng(7)
    frames = rng.integers(0, 256, (2, 28, 56, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (1, 28, 28, 3), dtype=np.uint8)
    completions = [Completion(np.array([11, 12, 2], np.int32), np.array([-0.5, -1.25, -0.0], np.float32),
                              "<answer>(A)</answer>", "stop", {"accuracy": 1.0, "format": 1.0}, 2.0,
                              np.array([4, 4, 5], np.int32)),
                   Completion(np.array([13, 14], np.int32), np.array([-2.0, -3.5], np.float32), "(B", "length",
                              {"accuracy": 0.0, "format": 0.0}, 0.0, np.array([4, 4], np.int32))]
    common = dict(prompt_id="rec-1", generator_id="my-server", policy_version=4, model_id="Qwen/Qwen2.5-VL-3B-Instruct",
                  prompt_ids=np.array([151644, 872, 151652, 151656, 151653, 198], np.int32), answer="(A)",
                  completions=completions, prompt_text="<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>...",
                  meta={"kind": "direction", "temperature": 1.0}, created_at=1795000000.25)
    inline = [Visual("video", frames, 24.0, np.array([0, 23], np.int32)), Visual("image", image)]
    ref = [Visual("video", None, 24.0, np.array([0, 23], np.int32),
                  MediaRef("videos/a.mp4", 28, 56, frames_digest(frames), "auto")),
           Visual("image", None, 0.0, np.zeros(0, np.int32), MediaRef("images/b.png", 28, 28,
                                                                       frames_digest(image, "sha256"), "auto"))]
    return {
        "v3_reference": ScoredGroup(visuals=ref, group_id="golden-v3-reference", **common),
        "v3_inline": ScoredGroup(visuals=inline, group_id="golden-v3-inline", **common),
        "v2_inline": ScoredGroup(visuals=inline, group_id="golden-v2-inline", schema=2, **common),
    }


def _regen() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name, g in _examples().items():
        (GOLDEN / f"{name}.sgrp").write_bytes(encode(g))
        (GOLDEN / f"{name}.json").write_text(json.dumps(to_json(decode(encode(g))), indent=1) + "\n")


if os.environ.get("STREAMGRPO_REGEN_GOLDEN"):
    _regen()


@pytest.mark.parametrize("name", ["v3_reference", "v3_inline", "v2_inline"])
def test_golden_message_decodes_to_its_json_and_encodes_back_bit_for_bit(name):
    data = (GOLDEN / f"{name}.sgrp").read_bytes()
    doc = json.loads((GOLDEN / f"{name}.json").read_text())
    assert to_json(decode(data)) == doc
    assert encode(from_json(doc)) == data
    assert encode(_examples()[name]) == data  # what this release writes for the same group


def test_golden_files_are_all_checked():
    assert sorted(p.stem for p in GOLDEN.glob("*.sgrp")) == ["v2_inline", "v3_inline", "v3_reference"]
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == ["v2_inline", "v3_inline", "v3_reference"]
