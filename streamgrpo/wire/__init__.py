"""What travels between the roles: the ScoredGroup message (:mod:`.message`), its rules (:mod:`.contract`) and
its codec (:mod:`.codec`; the format in prose: docs/protocol.md), its arrays as raw bytes (:mod:`.arrays`),
visuals by reference (:mod:`.media`), and the one dtype table the message and the weight channel share
(:mod:`.dtypes`). The message's API is importable from here."""

from streamgrpo.wire.arrays import WireError
from streamgrpo.wire.codec import decode, encode, encode_parts
from streamgrpo.wire.contract import inline, normalized, validate
from streamgrpo.wire.media import MediaRef
from streamgrpo.wire.message import (
    DEFAULT_MAX_BYTES,
    LOGPROB_MAX,
    LOGPROB_MIN,
    MAGIC,
    SCHEMA_VERSION,
    SCHEMAS,
    Completion,
    ScoredGroup,
    Source,
    Visual,
)

__all__ = ["DEFAULT_MAX_BYTES", "LOGPROB_MAX", "LOGPROB_MIN", "MAGIC", "SCHEMAS", "SCHEMA_VERSION", "Completion",
           "MediaRef", "ScoredGroup", "Source", "Visual", "WireError", "decode", "encode", "encode_parts", "inline",
           "normalized", "validate"]
