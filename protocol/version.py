"""The wire protocol's version. Peers that speak another version are refused with a clear error."""

PROTOCOL_VERSION = 2
# 2: Step.sampling is optional (None = greedy) and left off the wire for greedy runs.
