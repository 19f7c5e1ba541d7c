"""The wire protocol's version. Peers that speak another version are refused with a clear error."""

PROTOCOL_VERSION = 4
# 2: Step.sampling is optional (None = greedy) and left off the wire for greedy runs.
# 3: new activation codecs blockwise8/blockwise4 on the wire (protocol/compression.py).
#    Also Step.return_logits/return_hidden and the RunOutputs message (forward passes: logits and
#    final hidden states from the tail).
# 4: hostile-peer hardening, head drafts in results and the rejection (DSSD) exchange; each change
#    adds its line here.
