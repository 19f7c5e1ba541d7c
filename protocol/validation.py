"""DHT records that only the peer named in the subkey can write.

Servers announce themselves under ``"{model}.{block}"`` with their base58 peer id as the subkey
(see :mod:`protocol.records`). hivemind's RSASignatureValidator would bind such a record to an RSA key
written into the subkey as ``[owner:...]``, but not to the peer id, so anybody could write
``"<victim id>[owner:<own key>]"``. :class:`PeerIdSignatureValidator` instead requires that the
subkey *is* a peer id, and that the value carries the public key hashing to that id plus a
signature by it, so announcing under another peer's id needs that peer's private key.

Which records are protected: validators only ever see the *hash* of a key (``DHTID`` bytes), so a
rule like "keys not starting with '_'" cannot be checked. The policy is therefore deny-by-default:
every record is protected except those under keys explicitly listed in ``unprotected_keys``
(default: :data:`UNPROTECTED_KEYS`). Under a protected key, subkey-less values and subkeys that are
not peer ids are rejected too, so nobody can slip a fake entry into a block's server list under a
made-up subkey. Add any new shared key (e.g. another ``"_specswarm.*"`` key) to ``unprotected_keys``
on every peer, or its stores will fail.

Wire format of a protected value: ``msgpack([value, public_key, signature])`` where ``value`` is the
original serialized value, ``public_key`` the protobuf ``crypto.pb.PublicKey`` and ``signature``
signs ``msgpack([DOMAIN, key, subkey, value, expiration_time])``. Signing the expiration time
means a replayed old record cannot outlive its original expiration, and hivemind keeps the newest
expiration per subkey, so replaying it cannot override a fresher record either.

Readers should still take the server's identity from the subkey, not from fields in the value.

Size: every value, protected or not (the registry too), is refused above ``MAX_RECORD_BYTES``, so
no peer stores, and no reader accepts, a megabyte of names or pings (an honest record is under
2 KiB). What the fields may hold is checked by readers (``protocol.records``), and which precisions a
record may announce here (:func:`precision_problem`): ``dtype`` one of :data:`SERVED_DTYPES`,
``quantization`` one of :data:`SERVED_QUANTIZATIONS`. A server that announced a precision nobody
else has would never be audited (audits compare servers of one precision only), so
``protocol.dht_records`` drops such a record, with the reason in its log.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_logger

from protocol.identity import Identity, peer_id_from_public_key, verify_signature
from protocol.records import MODELS_KEY

logger = get_logger(__name__)

__all__ = [
    "MAX_RECORD_BYTES",
    "PeerIdSignatureValidator",
    "SERVED_DTYPES",
    "SERVED_QUANTIZATIONS",
    "UNPROTECTED_KEYS",
    "precision_problem",
]

UNPROTECTED_KEYS: tuple[str, ...] = (MODELS_KEY,)
MAX_RECORD_BYTES = 64 * 1024  # one subkey's value as stored (signed), protected or not
DOMAIN = b"specswarm.peer-record.v1"  # keeps these signatures from meaning anything elsewhere

# What a server of this project can announce (swarm.server --dtype, server.quantization.Quant; None
# in a record reads as "none"). Anything else is a record no server of this project writes.
SERVED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
SERVED_QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "nf4")


def precision_problem(dtype: object, quantization: object) -> Optional[str]:
    """Why a record's precision is not one this project serves, or None when it is."""
    if dtype not in SERVED_DTYPES:
        return f"dtype {str(dtype)[:64]!r} is not one of {SERVED_DTYPES}"
    if quantization is not None and quantization not in SERVED_QUANTIZATIONS:
        return f"quantization {str(quantization)[:64]!r} is not one of {SERVED_QUANTIZATIONS}"
    return None


class PeerIdSignatureValidator(RecordValidatorBase):
    """Protected records must be signed by the peer whose base58 id is their subkey.

    :param identity: this peer's identity; records whose subkey is its peer id get signed on
      store. ``None`` makes a validate-only instance (can read, cannot write protected records).
    :param unprotected_keys: raw DHT keys whose records pass through untouched.
    """

    def __init__(self, identity: Optional[Identity] = None, unprotected_keys: Iterable[str] = UNPROTECTED_KEYS):
        self._identity = identity
        self._local_subkey = None if identity is None else MSGPackSerializer.dumps(identity.peer_id.to_base58())
        self._unprotected = frozenset(DHTID.generate(source=key).to_bytes() for key in unprotected_keys)

    def is_protected(self, record: DHTRecord) -> bool:
        return record.key not in self._unprotected

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES:
            logger.debug(f"Record of {len(record.value)} bytes exceeds {MAX_RECORD_BYTES}")
            return False
        if not self.is_protected(record):
            return True
        unpacked = _unpack(record.value)
        if unpacked is None:
            logger.debug(f"Protected record is not signed: {record}")
            return False
        value, public_key, signature = unpacked
        owner = _subkey_peer_id(record.subkey)
        if owner is None or peer_id_from_public_key(public_key) != owner:
            logger.debug(f"Subkey is not the peer id of the signing key: {record}")
            return False
        if not verify_signature(public_key, _payload(dataclasses.replace(record, value=value)), signature):
            logger.debug(f"Bad signature: {record}")
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        """Wrap records that are ours to sign; others stay as they are (and fail validation if protected)."""
        if self._identity is None or not self.is_protected(record) or record.subkey != self._local_subkey:
            return record.value
        signature = self._identity.sign(_payload(record))
        return msgpack.packb([record.value, self._identity.public_key_bytes, signature], use_bin_type=True)

    def strip_value(self, record: DHTRecord) -> bytes:
        if not self.is_protected(record):
            return record.value
        unpacked = _unpack(record.value)
        return record.value if unpacked is None else unpacked[0]

    @property
    def priority(self) -> int:
        # Outermost layer: signs last (over what RSASignatureValidator=10 or schemas produced) and
        # validates/strips first, so lower-priority validators see the value they produced.
        return 20


def _payload(record: DHTRecord) -> bytes:
    # float(): a sender may pass an int expiration, receivers always get a protobuf double back.
    fields = [DOMAIN, record.key, record.subkey, record.value, float(record.expiration_time)]
    return msgpack.packb(fields, use_bin_type=True)


def _unpack(raw: bytes) -> Optional[tuple[bytes, bytes, bytes]]:
    try:
        items = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    if isinstance(items, list) and len(items) == 3 and all(isinstance(item, bytes) for item in items):
        return tuple(items)
    return None


def _subkey_peer_id(subkey: bytes) -> Optional[PeerID]:
    try:
        text = MSGPackSerializer.loads(subkey)
        return PeerID.from_base58(text) if isinstance(text, str) and text else None
    except Exception:
        return None
