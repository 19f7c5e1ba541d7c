"""Records under block keys can only be written by the peer whose id is the subkey."""

from __future__ import annotations

import dataclasses
import os
import pickle

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocol.identity import load_or_create_identity
from protocol.records import MODELS_KEY, ServerInfo, block_key
from protocol.validation import PeerIdSignatureValidator

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ids():
    return load_or_create_identity(None), load_or_create_identity(None)


def _record(key: str, subkey, value, expiration_time: float = 1e10) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration_time,
    )


def _signed(validator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_identity_file_and_peer_id(tmp_path, ids):
    a, _ = ids
    assert oct(os.stat(a.path).st_mode & 0o777) == "0o400"
    with open(a.path, "rb") as f:
        assert a.peer_id == PeerID.from_identity(f.read())
    path = str(tmp_path / "id.key")
    first = load_or_create_identity(path)
    assert load_or_create_identity(path).peer_id == first.peer_id  # reloads, doesn't regenerate
    assert pickle.loads(pickle.dumps(first)).peer_id == first.peer_id


def test_sign_validate_strip(ids):
    a, b = ids
    val_a, val_b, reader = PeerIdSignatureValidator(a), PeerIdSignatureValidator(b), PeerIdSignatureValidator()
    value = {"peer_id": a.peer_id.to_base58(), "start_block": 0}

    good = _signed(val_a, _record("m.0", a.peer_id.to_base58(), value))
    assert reader.validate(good) and val_b.validate(good)
    assert MSGPackSerializer.loads(reader.strip_value(good)) == value

    # A's signed value copied under B's peer id: key doesn't hash to the subkey
    assert not reader.validate(dataclasses.replace(good, subkey=MSGPackSerializer.dumps(b.peer_id.to_base58())))
    # tampered value, key or expiration: signature no longer verifies
    tampered_value = good.value.replace(MSGPackSerializer.dumps(0), MSGPackSerializer.dumps(7))
    assert tampered_value != good.value and not reader.validate(dataclasses.replace(good, value=tampered_value))
    assert not reader.validate(dataclasses.replace(good, key=DHTID.generate(source="m.1").to_bytes()))
    assert not reader.validate(dataclasses.replace(good, expiration_time=good.expiration_time + 1))

    # B can't sign for A: sign_value leaves it unsigned, and unsigned protected records fail
    forged = _record("m.0", a.peer_id.to_base58(), value)
    assert val_b.sign_value(forged) == forged.value
    assert not reader.validate(forged)
    assert not reader.validate(_record("m.0", None, value))  # no subkey under a protected key
    assert not reader.validate(_signed(val_a, _record("m.0", "not-a-peer-id", value)))

    # unprotected keys pass through unchanged
    models = _record(MODELS_KEY, "m", {"num_blocks": 4})
    assert val_a.sign_value(models) == models.value and reader.validate(models)
    assert reader.strip_value(models) == models.value


def test_composes_with_rsa_validator(ids):
    a, _ = ids
    composite = CompositeValidator([RSASignatureValidator(), PeerIdSignatureValidator(a)])
    record = _record("m.0", a.peer_id.to_base58(), {"x": 1})
    signed = _signed(composite, record)
    assert composite.validate(signed) and composite.strip_value(signed) == record.value
    assert not composite.validate(dataclasses.replace(signed, subkey=MSGPackSerializer.dumps("x")))

    # an int expiration at signing still verifies once it comes back as a protobuf double
    validator = PeerIdSignatureValidator(a)
    signed = _signed(validator, _record("m.0", a.peer_id.to_base58(), {"x": 1}, expiration_time=12345))
    assert validator.validate(dataclasses.replace(signed, expiration_time=12345.0))


def test_dht_only_owner_can_write(ids):
    a, b = ids
    dht_a = dht_b = mallory = None
    try:
        dht_a = hivemind.DHT(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=a.path,
            record_validators=[PeerIdSignatureValidator(a)],
            start=True,
        )
        assert dht_a.peer_id == a.peer_id  # the daemon runs with our key
        dht_b = hivemind.DHT(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=dht_a.get_visible_maddrs(),
            identity_path=b.path,
            check_if_identity_free=False,
            record_validators=[PeerIdSignatureValidator(b)],
            start=True,
        )
        assert dht_b.peer_id == b.peer_id

        key, a_id = block_key("m", 0), a.peer_id.to_base58()
        info = ServerInfo(peer_id=a_id, model="m", start_block=0, end_block=2).to_dict()
        assert dht_a.store(key, info, get_dht_time() + 60, subkey=a_id)

        found = dht_b.get(key, latest=True)
        assert found is not None and found.value[a_id].value == info
        assert ServerInfo.from_dict(found.value[a_id].value).peer_id == a_id

        fake = dict(info, start_block=1, throughput=1e9)
        assert not dht_b.store(key, fake, get_dht_time() + 120, subkey=a_id)
        for dht in (dht_a, dht_b):
            assert dht.get(key, latest=True).value[a_id].value == info

        # a peer that skips validation itself: honest peers refuse its forgery, A's record survives
        mallory = hivemind.DHT(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dht_a.get_visible_maddrs(), start=True
        )
        mallory.store(key, fake, get_dht_time() + 120, subkey=a_id)
        for dht in (dht_a, dht_b):
            assert dht.get(key, latest=True).value[a_id].value == info

        # unprotected keys work for anyone
        assert dht_b.store(MODELS_KEY, {"num_blocks": 2}, get_dht_time() + 60, subkey="m")
        assert dht_a.get(MODELS_KEY, latest=True).value["m"].value == {"num_blocks": 2}
    finally:
        for dht in (mallory, dht_b, dht_a):
            if dht is not None:
                dht.shutdown()
