"""A peer's long-lived identity: the RSA key its libp2p daemon runs with.

The same key file is handed to ``hivemind.DHT(identity_path=identity.path)``, so the peer id the
swarm sees is derived from this key. Because of that, a signature made with :meth:`Identity.sign`
proves "written by the owner of peer id X" and :mod:`protocol.validation` can tie DHT records to the
peer id that announces them (hivemind's own RSASignatureValidator only ties them to an RSA key
named in the key/subkey, which anybody can pair with somebody else's peer id).

The file format is exactly what ``hivemind.P2P.generate_identity`` writes: a protobuf
``crypto.pb.PrivateKey`` of type RSA whose ``data`` is the DER (PKCS#1) private key.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import tempfile
from typing import Optional

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

__all__ = ["Identity", "load_or_create_identity", "peer_id_from_public_key", "verify_signature"]

# Same scheme as hivemind.utils.crypto (RSA-PSS, MGF1/SHA-256, max salt), but raw signature bytes.
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_HASH = hashes.SHA256()


def peer_id_from_public_key(public_key_bytes: bytes) -> PeerID:
    """libp2p peer id of a protobuf-encoded ``crypto.pb.PublicKey``.

    Per the libp2p peer-id spec: encodings of at most 42 bytes are embedded with the identity
    multihash, longer ones (every RSA key) are hashed with sha2-256. Matches
    ``PeerID.from_identity``, which only works from the *private* key file.
    """
    if len(public_key_bytes) <= 42:
        return PeerID(bytes([0x00, len(public_key_bytes)]) + public_key_bytes)
    return PeerID(bytes([0x12, 0x20]) + hashlib.sha256(public_key_bytes).digest())


def verify_signature(public_key_bytes: bytes, data: bytes, signature: bytes) -> bool:
    """Check an :meth:`Identity.sign` signature against a protobuf-encoded RSA public key.

    Returns False (never raises) for malformed keys, non-RSA keys or bad signatures.
    """
    try:
        pb = crypto_pb2.PublicKey.FromString(public_key_bytes)
        if pb.key_type != crypto_pb2.KeyType.RSA:
            return False
        key = serialization.load_der_public_key(pb.data)
        if not isinstance(key, rsa.RSAPublicKey):
            return False
        key.verify(signature, data, _PADDING, _HASH)
        return True
    except Exception:  # DecodeError, ValueError, InvalidSignature, UnsupportedAlgorithm, ...
        return False


class Identity:
    """The libp2p RSA private key at ``path``; signs with RSA-PSS/SHA-256 like hivemind's keys."""

    def __init__(self, path: str, raw: bytes, fresh: bool = False):
        """``fresh``: this process generated the key just now, so no other peer can hold it and the
        DHT may skip hivemind's check that the identity is free (a second libp2p daemon that dials
        the initial peers: about a second of every server's and client's start)."""
        pb = crypto_pb2.PrivateKey.FromString(raw)
        if pb.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"{path}: only RSA identities are supported (got key type {pb.key_type})")
        key = serialization.load_der_private_key(pb.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"{path}: key data is not an RSA private key")
        self.path, self._raw, self._key, self.fresh = path, raw, key, fresh
        spki = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.public_key_bytes: bytes = crypto_pb2.PublicKey(
            key_type=crypto_pb2.KeyType.RSA, data=spki
        ).SerializeToString()
        self.peer_id: PeerID = peer_id_from_public_key(self.public_key_bytes)
        # Guard against drifting from what the daemon computes for the same file.
        assert self.peer_id == PeerID.from_identity(raw), "peer id derivation disagrees with hivemind"

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data, _PADDING, _HASH)

    def __reduce__(self):  # the cryptography key object itself does not pickle
        return Identity, (self.path, self._raw, self.fresh)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id.to_base58()}, path={self.path!r})"


def load_or_create_identity(path: Optional[str]) -> Identity:
    """Load the identity at ``path``, creating it (mode 0o400) first if the file does not exist.

    With ``path=None`` a fresh identity is written to a temporary file that is deleted when the
    process exits; pass ``identity.path`` to ``hivemind.DHT(identity_path=...)`` while it lives.
    """
    fresh = path is None or not os.path.isfile(path)
    if path is None:
        fd, path = tempfile.mkstemp(prefix="specswarm-identity-", suffix=".key")  # 0o600, ours alone
        os.close(fd)
        atexit.register(_remove_quietly, path)
        P2P.generate_identity(path)  # overwrites the empty file, then chmods it to 0o400
    elif not os.path.isfile(path):
        P2P.generate_identity(path)
    with open(path, "rb") as f:
        return Identity(path, f.read(), fresh)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
