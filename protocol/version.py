"""The wire protocol's version. Peers that speak another version are refused with a clear error."""

PROTOCOL_VERSION = 10
# 2: Step.sampling is optional (None = greedy): a greedy run sends nil (1 byte) instead of the parameters.
# 3: new activation codecs blockwise8/blockwise4 on the wire (protocol/compression.py).
#    Also Step.return_logits/return_hidden and the RunOutputs message (forward passes: logits and
#    final hidden states from the tail).
# 4: hostile-peer hardening, tail drafts in results and the rejection (DSSD) exchange; each change
#    adds its line here.
#    Verdicts and subscriptions: OpenSession.secret_hash (sha256 of a client secret) and
#    Subscribe.secret; per-protocol frame limits from the model, at most max_positions_per_step
#    positions per Step (chunked prefill); error codes frame_too_large, step_too_large,
#    unauthorized, queue_full (docs/protocol.md).
#    Rejection (DSSD) exchange: Step.draft_q (float16 q of each draft), StepResult.correction_ids/
#    correction_p (top-K of p on a rejection); SamplingParams is a map of one-letter keys without
#    its defaults (14 bytes for seeded top-k sampling instead of 37).
#    Tail drafts: Step.tail_drafts (how many the client wants), StepResult.drafts (the tail's drafter).
#    Hop.addrs: circuit addresses of a hop behind NAT (docs/nat.md).
#    Step.sampling: left out when unchanged since the session's previous Step (was: left out for greedy).
#    Token trees: messages TreeStep (a Step plus parents, a parent index per draft, and tree_path, the
#    previous tree run's accepted path, gathered into a chain before the trim) and TreeResult (a
#    StepResult plus path, the accepted path); chains still travel as Step/StepResult, byte for byte
#    as before (docs/protocol.md, "Token trees").
# 5: one meaning per word: runs the tail starts at the head are "looped runs" (messages LoopedStep,
#    LoopedResult, LoopedRun with tags lstep/lresult/loop; Step field loop_runs, result field looped),
#    and the tail's drafter asks with Step.tail_drafts (was head_start/head_drafts: same fields).
# 6: plain messages: Step and StepResult hold every field (Step: loop_runs, parents, tree_path at its
#    end; StepResult: looped, run_drafts, path at its end), encoded as arrays cut after the last field
#    not at its default (protocol.messages.encode), so a plain chain lap is smaller than in v5 and the
#    optional fields cost it nothing. Gone: TreeStep, TreeResult, LoopedStep, LoopedResult (tags
#    tree, tree_result, lstep, lresult); LoopedRun (tag loop) is now [step, accepted].
#    Verdicts bound to what was verified: StepResult.step_digest (a trailing field, 5 bytes), a
#    digest of the Step the tail verified keyed with the session's secret (protocol/digest.py).
#    Every message's session_id is at most 64 characters (longer: malformed).
#    Records carry max_positions_per_step (8..65536; clients chunk prefill to the smallest on their
#    route instead of failing with step_too_large); routers skip servers of another protocol_version.
# 7: fine-tuning (docs/design.md, "Fine-tuning"): the training protocol /specswarm/train/1 with messages
#    TrainForward (tag train) and TrainBackward (tag backward); OpenSession.num_prompts (tuned prompts the
#    head computes a session's first positions from). A v6 server would ignore num_prompts and compute
#    those positions from placeholder ids, so routes never mix the two versions.
#    Also in 7: structured outputs and output rules: SamplingParams.constraint (key "c": kind, spec), a JSON schema,
#    regex or grammar the tail masks its choices with (docs/design.md, "Constraints at the tail"),
#    output_start ("o": where the output begins), presence_penalty ("e"), frequency_penalty ("f") and
#    logit_bias ("b"); a v6 tail would ignore the keys and choose without them, hence a new version.
# 8: LoRA adapters on servers (docs/fine_tuning.md, "LoRA adapters"): ServerInfo.adapters (the names a server
#    serves), OpenSession.active_adapter and TrainForward.active_adapter (the adapter every hop applies), error
#    code unknown_adapter. A v7 server would ignore active_adapter and answer without the adapter.
# 9: error code compile_budget: the tail's ration of fresh constraint compiles, kept per requesting peer and
#    source address (server/compile_budget.py), is spent (was: busy, one ration per tail); sent on the client's
#    results stream only (relayed up the route it is a forgery: a route fault, client/_remote_session.py);
#    StepResult.tail_costs (protocol/tail_costs.py), what verifying a run cost the tail;
#    multi-label sequence classification: TrainForward.multi_labels (a trailing field: one target in [0, 1]
#    per label; the tail's loss is their mean BCE-with-logits, as transformers' multi_label_classification).
#    A v8 tail would ignore it and score the row as single-label.
#    Rows longer than a step in chunks: TrainForward.chunk_index, num_chunks, chunk_offset, backward_only
#    (trailing fields; docs/design.md, "Long rows in chunks").
#    Single-span replacement: TrainForward.spares; ServerInfo.train_forwards (trailing fields).
#    Abandoned steps: TrainDrop (step ids and the route), passed hop by hop; deep prompt and classification
#    rows in chunks (no new field).
#    Backward budgets: ServerInfo.max_backward_bytes (a trailing field: what one row's backward may need through the
#    server's blocks, --max-backward-mib or its default); clients size a row's chunks to the smallest on the route.
#    Constraint.stop_token_ids (a trailing field): ids besides EOS that end a constrained output (the tail's
#    matcher counts them as stops); empty, a constraint's digest is its two fields as before.
#    Step.hidden_at (a trailing field, -1 by default): with return_hidden, the hidden state entering that block of the
#    tail's span instead of the final one (a dispute's bisection over the span's blocks, client/_bisection.py).
# 10: the verdict digest (StepResult.step_digest, protocol/digest.py) binds every field of the Step the tail verified:
#    also session_id, top_logprobs, return_logits, return_hidden, tail_drafts, loop_runs and hidden_at (a v9 tail
#    digested ids, positions, drafts, tree, draft_q and sampling only, so a hop could rewrite the rest unseen), as
#    (name, value) pairs of the fields not at their default; no field changes on the wire. A v9 tail's digest
#    would differ from a v10 client's on every Step, hence a new version.
#    Also in 10: seeded draws from NumPy's Philox raw words keyed by (seed, position, stream), a token as the
#    exponential race argmax(p / E) (protocol/seeded_draws.py), instead of torch's generator, whose stream torch does
#    not keep across versions: every peer draws alike whatever its torch; a v9 peer draws other tokens for a seed.
