"""The wire protocol's version. Peers that speak another version are refused with a clear error."""

PROTOCOL_VERSION = 1
