"""``streamgrpo keys``: CURVE key pairs for the weight channel (:mod:`streamgrpo.transport.weights.keys`)."""

from __future__ import annotations

from streamgrpo.transport.weights.keys import generate_keys


def main(args) -> int:
    print(generate_keys(args.out, clients=args.clients).describe())
    return 0
