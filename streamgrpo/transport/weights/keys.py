"""CURVE key pairs for the weight channel (``streamgrpo keys --out DIR [--clients N]``).

Layout of a keys directory (ZeroMQ's ZPL certificate files, as ``zmq.auth`` reads them)::

    DIR/server.key              server public key   (0644)  learner and every generator
    DIR/server.key_secret       server secret key   (0600)  learner only
    DIR/clients/                                    (0700)
    DIR/clients/client-K.key         public  (0644)  the learner authorises every *.key here
    DIR/clients/client-K.key_secret  secret  (0600)  generator K only
    DIR/clients/client-evaluator.key(_secret)        the evaluator's pair (always made)

To revoke a generator, delete its ``clients/client-K.key`` and restart the learner; to add one,
run ``streamgrpo keys --out DIR --clients N`` again with a larger N (existing keys are kept).
Certificates are made by ``zmq.auth.create_certificates`` in a private staging folder and linked
into place, so a secret file is never readable by others and existing pairs are never overwritten.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

SERVER = "server"
CLIENTS_DIR = "clients"
EVALUATOR = "client-evaluator"
"""The evaluator's client key pair: it subscribes to the weights like a generator."""


@dataclass(frozen=True)
class KeyFiles:
    """Paths written (or found) by :func:`generate_keys`."""

    keys_dir: Path
    server_public: Path
    server_secret: Path
    clients: list[tuple[Path, Path]]  # (public, secret) per client, in order
    evaluator: tuple[Path, Path]  # (public, secret) of the evaluator's pair

    def describe(self) -> str:
        lines = [
            f"CURVE keys in {self.keys_dir}",
            f"  learner:   {self.server_secret.name} (secret, 0600) + {CLIENTS_DIR}/*.key (authorised clients)",
            f"  generator: {self.server_public.name} + its own {CLIENTS_DIR}/client-K.key and client-K.key_secret",
            f"  evaluator: {self.server_public.name} + {CLIENTS_DIR}/{EVALUATOR}.key and {EVALUATOR}.key_secret",
            f"  clients:   {len(self.clients)}; set weights.curve_keys_dir={self.keys_dir} in every process",
        ]
        return "\n".join(lines)


def _pair(folder: Path, name: str) -> tuple[Path, Path]:
    """``folder/name.key`` (0644) and ``folder/name.key_secret`` (0600), made by ``zmq.auth``.

    The pair is written inside a private (0700) staging folder, the secret file made 0600 there, and
    both are then linked into place without overwriting: a secret key is never readable by others,
    not even for a moment, and an existing pair is kept."""
    pub, sec = folder / f"{name}.key", folder / f"{name}.key_secret"
    if pub.exists() and sec.exists():
        return pub, sec
    if pub.exists() or sec.exists():
        raise FileExistsError(f"keys: {pub} / {sec}: only one half of the key pair exists; remove it and rerun")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".staging-") as tmp:  # mkdtemp: mode 0700
        made_pub, made_sec = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
        os.chmod(made_sec, 0o600)
        os.chmod(made_pub, 0o644)
        os.link(made_sec, sec)  # link() never replaces an existing file
        os.link(made_pub, pub)
    return pub, sec


def generate_keys(out_dir: str | os.PathLike, clients: int = 1) -> KeyFiles:
    """Create the server key pair and ``clients`` client key pairs; existing pairs are kept."""
    if clients < 0:
        raise ValueError(f"keys: --clients must be >= 0, got {clients}")
    if not zmq.has("curve"):
        raise RuntimeError("keys: this libzmq was built without CURVE support")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    cdir = root / CLIENTS_DIR
    cdir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(cdir, 0o700)
    server_pub, server_sec = _pair(root, SERVER)
    pairs = [_pair(cdir, f"client-{k}") for k in range(clients)]
    return KeyFiles(root, server_pub, server_sec, pairs, _pair(cdir, EVALUATOR))


def server_keys(keys_dir: str | os.PathLike, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) of the server; ``secret=True`` requires the secret file (the learner)."""
    root = Path(keys_dir)
    path = root / (f"{SERVER}.key_secret" if secret else f"{SERVER}.key")
    if not path.is_file():
        raise FileNotFoundError(f"keys: {path} not found (make keys with `streamgrpo keys --out {root}`)")
    public, sec = zmq.auth.load_certificate(path)
    if secret and not sec:
        raise ValueError(f"keys: {path} holds no secret key")
    return public, sec


def client_keys(keys_dir: str | os.PathLike, client: str | os.PathLike | None = None) -> tuple[bytes, bytes]:
    """(public, secret) of a client key pair.

    ``client`` is a name in ``DIR/clients`` (``client-3``), a path to a ``.key_secret`` file, or
    None for the first client pair in ``DIR/clients`` (name order).
    """
    cdir = Path(keys_dir) / CLIENTS_DIR
    if client is None:
        found = sorted(cdir.glob("*.key_secret")) if cdir.is_dir() else []
        if not found:
            raise FileNotFoundError(f"keys: no client key pair in {cdir} (make some with `streamgrpo keys --clients N`)")
        path = found[0]
    else:
        path = Path(client)
        if not path.is_file():
            path = cdir / f"{client}.key_secret"
    if not path.is_file():
        raise FileNotFoundError(f"keys: client key {client!r} not found (looked for {path})")
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"keys: {path} holds no secret key")
    return public, secret


def authorised_dir(keys_dir: str | os.PathLike) -> Path:
    """Folder whose ``*.key`` public keys the learner accepts."""
    return Path(keys_dir) / CLIENTS_DIR
