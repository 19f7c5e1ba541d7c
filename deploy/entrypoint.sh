#!/bin/sh
# specswarm's entry point: the container's ENTRYPOINT and what the systemd units run.
#
#   specswarm-entrypoint [server|bootstrap|dashboard|api] [more CLI arguments ...]
#
# Maps environment variables to the command line of `python -m swarm.server` (the default role),
# `swarm.bootstrap`, `swarm.dashboard` or `swarm.api` and execs it, so SIGTERM reaches Python
# (a server then announces DRAINING, lets its sessions finish and leaves). Any other first
# argument is run as a command (`docker run -it IMAGE bash`). Unset variables are left out, so the
# CLI's own defaults apply (--device auto --dtype auto --quant auto for the server).
#
#   SPECSWARM_INITIAL_PEERS       multiaddrs of the swarm, separated by spaces or commas
#   SPECSWARM_INITIAL_PEERS_FILE  when SPECSWARM_INITIAL_PEERS is empty: wait (up to
#                                 SPECSWARM_WAIT_SECONDS, default 120) until this file is not
#                                 empty and take its lines; the bootstrap role writes its own
#                                 addresses there instead (compose.yaml shares it in a volume)
#   MODEL            server, api: alias, hub repo id or local folder (api: several, space-separated)
#   NUM_BLOCKS       server: --num-blocks (placed where the swarm needs them most)
#   BLOCKS           server: --blocks START:END (neither: as many blocks as fit in memory)
#   HOST, PORT       listen address (default 0.0.0.0) and TCP port (server 31330, bootstrap 31337,
#                    dashboard 8080, api 8000)
#   ANNOUNCE_MADDRS  server, bootstrap: the addresses other peers should dial (public IP, port forward)
#   PUBLIC_NAME      server: the name on the dashboard
#   DEVICE, DTYPE, QUANT, CACHE_TOKENS   server: --device, --dtype, --quant, --cache-tokens
#   IDENTITY_PATH    server, bootstrap: private key file that keeps the peer id across restarts
#   API_KEY_FILE     api: accept only the bearer keys in this file
#   LOG_LEVEL        --log-level
#   EXTRA_ARGS       more arguments, split at whitespace (no quoting)
#   PYTHON           the interpreter (default python3)
#   ENTRYPOINT_DRY_RUN=1  print the command, one argument per line, instead of running it
set -eu
set -f  # no globbing when lists (addresses, EXTRA_ARGS) are split at whitespace

role=server
case "${1:-}" in
    server | bootstrap | dashboard | api) role=$1; shift ;;
    "" | -*) ;;
    *) exec "$@" ;;
esac

die() {
    echo "specswarm-entrypoint: $*" >&2
    exit 2
}

peers=$(printf '%s' "${SPECSWARM_INITIAL_PEERS:-}" | tr ',' ' ')
peers_file=${SPECSWARM_INITIAL_PEERS_FILE:-}
if [ "$role" != bootstrap ] && [ -z "$(printf '%s' "$peers" | tr -d ' \t')" ] && [ -n "$peers_file" ]; then
    waited=0
    until [ -s "$peers_file" ]; do
        [ "$waited" -lt "${SPECSWARM_WAIT_SECONDS:-120}" ] || die "$peers_file is still empty after ${waited} s (is the bootstrap node up?)"
        sleep 1
        waited=$((waited + 1))
    done
    peers=$(tr ',\n' '  ' <"$peers_file")
fi
export SPECSWARM_INITIAL_PEERS="$peers"  # the server reads it itself (protocol/config.py)

# Arguments are prepended, so EXTRA_ARGS and then the command's own arguments come last.
set -- ${EXTRA_ARGS:-} "$@"
if [ -n "${LOG_LEVEL:-}" ]; then set -- --log-level "$LOG_LEVEL" "$@"; fi

case "$role" in
server)
    module=swarm.server
    [ -n "${MODEL:-}" ] || die "set MODEL to a model alias (smollm2-135m, deepseek-v4-pro, ...), a hub repo id or a local folder"
    if [ -n "${NUM_BLOCKS:-}" ] && [ -n "${BLOCKS:-}" ]; then die "set NUM_BLOCKS or BLOCKS, not both"; fi
    if [ -n "${NUM_BLOCKS:-}" ]; then set -- --num-blocks "$NUM_BLOCKS" "$@"; fi
    if [ -n "${BLOCKS:-}" ]; then set -- --blocks "$BLOCKS" "$@"; fi
    if [ -n "${ANNOUNCE_MADDRS:-}" ]; then set -- --announce-maddrs $ANNOUNCE_MADDRS "$@"; fi
    if [ -n "${PUBLIC_NAME:-}" ]; then set -- --public-name "$PUBLIC_NAME" "$@"; fi
    if [ -n "${DEVICE:-}" ]; then set -- --device "$DEVICE" "$@"; fi
    if [ -n "${DTYPE:-}" ]; then set -- --dtype "$DTYPE" "$@"; fi
    if [ -n "${QUANT:-}" ]; then set -- --quant "$QUANT" "$@"; fi
    if [ -n "${CACHE_TOKENS:-}" ]; then set -- --cache-tokens "$CACHE_TOKENS" "$@"; fi
    if [ -n "${IDENTITY_PATH:-}" ]; then set -- --identity-path "$IDENTITY_PATH" "$@"; fi
    set -- --model "$MODEL" --host "${HOST:-0.0.0.0}" --port "${PORT:-31330}" "$@"
    ;;
bootstrap)
    module=swarm.bootstrap
    if [ -n "$(printf '%s' "$peers" | tr -d ' \t')" ]; then set -- --initial-peers $peers "$@"; fi
    if [ -n "${ANNOUNCE_MADDRS:-}" ]; then set -- --announce-maddrs $ANNOUNCE_MADDRS "$@"; fi
    if [ -n "${IDENTITY_PATH:-}" ]; then set -- --identity-path "$IDENTITY_PATH" "$@"; fi
    set -- --host "${HOST:-0.0.0.0}" --port "${PORT:-31337}" "$@"
    ;;
dashboard | api)
    [ -n "$(printf '%s' "$peers" | tr -d ' \t')" ] || die "set SPECSWARM_INITIAL_PEERS (or SPECSWARM_INITIAL_PEERS_FILE) to the swarm's multiaddrs"
    if [ "$role" = dashboard ]; then
        module=swarm.dashboard
        set -- --host "${HOST:-0.0.0.0}" --port "${PORT:-8080}" "$@"
    else
        module=swarm.api
        if [ -n "${API_KEY_FILE:-}" ]; then set -- --api-key-file "$API_KEY_FILE" "$@"; fi
        if [ -n "${MODEL:-}" ]; then set -- --model $MODEL "$@"; fi
        set -- --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" "$@"
    fi
    set -- --initial-peers $peers "$@"
    ;;
esac

set -- "${PYTHON:-python3}" -m "$module" "$@"
if [ "${ENTRYPOINT_DRY_RUN:-}" = 1 ]; then
    printf '%s\n' "$@"
    exit 0
fi
if [ "$role" = bootstrap ] && [ -n "$peers_file" ]; then
    exec "$@" >"$peers_file"  # its stdout is its multiaddrs, one a line
fi
exec "$@"
