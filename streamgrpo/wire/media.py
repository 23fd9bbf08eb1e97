"""Visuals by reference (wire schema 3): where the pixels come from instead of the pixels.

A :class:`MediaRef` names the file a video or image was decoded from (a path relative to the
learner's ``data.media_root``, or an absolute path), the decoder setting and the resize target; the
frame indices travel in the :class:`~streamgrpo.wire.Visual` as before. ``digest`` is a hash of the
exact pixel bytes the generator fed its model (``T x H x W x 3`` uint8 in C order): the learner
decodes the same frames with the same code (:func:`streamgrpo.data.video.decode_ref`), recomputes the
digest and trains only when the two agree. A changed file or another decoder build gives other
pixels, so another digest: the group is dead-lettered, never trained on other pixels.

Digests are ``"<algorithm>:<hex>"``; :data:`DIGESTS` lists the accepted algorithms: ``xxh3_128``
(what streamgrpo's generators write: ~10 GB/s) and the standard library's ``sha256`` and
``blake2b`` (for producers without xxhash). Pure: no I/O here.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from streamgrpo.wire.arrays import WireError

DECODERS = ("auto", "decord", "pyav")  # data.video_backend values; images always decode with PIL
MAX_PATH_CHARS = 4096
MAX_SIDE = 1 << 16
MAX_FRAMES = 4096  # frames of one video by reference (data.max_frames' own bound)


def _xxh3_128(buf: memoryview) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(buf)


DIGESTS = {  # algorithm -> (hex digits, function of the bytes)
    "xxh3_128": (32, _xxh3_128),
    "sha256": (64, lambda b: hashlib.sha256(b).hexdigest()),
    "blake2b": (128, lambda b: hashlib.blake2b(b).hexdigest()),
}
DEFAULT_DIGEST = "xxh3_128"
_DIGEST_RE = re.compile(r"^([a-z0-9_]+):([0-9a-f]+)$")


@dataclass(frozen=True)
class MediaRef:
    """Where one visual's pixels come from, and the digest they must have."""

    path: str  # relative to the learner's data.media_root, or absolute
    height: int  # resize target of every frame
    width: int
    digest: str  # "<algorithm>:<hex>" of the T x H x W x 3 uint8 frames (C order)
    decoder: str = "auto"  # data.video_backend the generator decoded with (videos)


def frames_digest(frames: np.ndarray, algorithm: str = DEFAULT_DIGEST) -> str:
    """``"<algorithm>:<hex>"`` of a uint8 frame array's bytes in C order."""
    hexdigits, fn = DIGESTS[algorithm]
    data = np.ascontiguousarray(frames, dtype=np.uint8)
    return f"{algorithm}:{fn(memoryview(data).cast('B'))}"


def digest_matches(frames: np.ndarray, digest: str) -> bool:
    """Whether ``frames`` hash to ``digest`` (with the digest's own algorithm)."""
    algorithm = digest.split(":", 1)[0]
    return algorithm in DIGESTS and frames_digest(frames, algorithm) == digest


def _fail(path: str, msg: str) -> NoReturn:
    raise WireError(f"{path}: {msg}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_ref(ref: Any, p: str) -> None:
    """Raise :class:`WireError` naming the first field of ``ref`` (at ``p``) that breaks the contract."""
    if not isinstance(ref, MediaRef):
        _fail(p, f"expected a MediaRef, got {type(ref).__name__}")
    if not isinstance(ref.path, str) or not ref.path:
        _fail(f"{p}.path", "expected a non-empty string")
    if len(ref.path) > MAX_PATH_CHARS or "\x00" in ref.path:
        _fail(f"{p}.path", f"not a usable path (over {MAX_PATH_CHARS} characters, or a NUL byte)")
    for side in ("height", "width"):
        x = getattr(ref, side)
        if not (_is_int(x) and 1 <= x <= MAX_SIDE):
            _fail(f"{p}.{side}", f"expected an integer in [1, {MAX_SIDE}], got {x!r}")
    if ref.decoder not in DECODERS:
        _fail(f"{p}.decoder", f"{ref.decoder!r} is not one of {', '.join(DECODERS)}")
    m = _DIGEST_RE.match(ref.digest) if isinstance(ref.digest, str) else None
    if m is None:
        _fail(f"{p}.digest", f"expected '<algorithm>:<lowercase hex>', got {ref.digest!r}")
    algorithm, hexpart = m.groups()
    if algorithm not in DIGESTS:
        _fail(f"{p}.digest", f"algorithm {algorithm!r} is not one of {', '.join(DIGESTS)}")
    if len(hexpart) != DIGESTS[algorithm][0]:
        _fail(f"{p}.digest", f"{algorithm} has {DIGESTS[algorithm][0]} hex digits, got {len(hexpart)}")


def ref_to_wire(ref: MediaRef) -> dict[str, Any]:
    return {"path": ref.path, "height": ref.height, "width": ref.width, "digest": ref.digest, "decoder": ref.decoder}


def ref_from_wire(x: Any, p: str) -> MediaRef:
    if not isinstance(x, dict):
        _fail(p, f"expected a mapping, got {type(x).__name__}")
    missing = [k for k in ("path", "height", "width", "digest", "decoder") if k not in x]
    if missing:
        _fail(f"{p}.{missing[0]}", "missing")
    return MediaRef(path=x["path"], height=x["height"], width=x["width"], digest=x["digest"], decoder=x["decoder"])
