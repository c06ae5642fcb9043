#!/bin/sh
# flower-supernode with the same arguments, saying what to do when the SuperLink refuses this node's key.
#
#   sh docker/supernode.sh --root-certificates ca.crt --superlink HOST:PORT --auth-supernode-private-key KEY ...
#
# Flower's SuperNode (1.42) ends with "Exit Code: 305 ... [code: 2004] Failed to activate SuperNode." (process
# status 1) both when its public key is not registered and when another SuperNode holding the same key is
# connected (a key copied to a second machine, or this node's own session from before a crash, which lapses
# about a minute later); its message names neither the key nor the setting. This script passes every line
# through, and after that failure adds a message naming the key file and the setting it came from
# (FIBOS_KEY_SETTING; default: the --auth-supernode-private-key flag), then exits with the SuperNode's own
# status, so a restart policy behaves as before. POSIX sh: Flower's images and the stand-ins have /bin/sh.
# docker/node.yml runs its SuperNode through it.
set -u

key=""
previous=""
for arg in "$@"; do
    if [ "$previous" = "--auth-supernode-private-key" ]; then
        key=$arg
    fi
    previous=$arg
done
setting=${FIBOS_KEY_SETTING:-"--auth-supernode-private-key ${key:-(not given)}"}

work=$(mktemp -d)
mkfifo "$work/out"
# Every line of the SuperNode through to stdout, noting Flower's refusal of the key.
(
    while IFS= read -r line || [ -n "$line" ]; do
        printf '%s\n' "$line"
        case $line in
            *"Failed to activate SuperNode"* | *"could not be activated"*) : >"$work/refused" ;;
        esac
    done <"$work/out"
) &
reader=$!
flower-supernode "$@" >"$work/out" 2>&1 &
node=$!
# docker stop (SIGTERM) and Ctrl-C reach the SuperNode, not only this shell (PID 1 in a container).
trap 'kill -TERM "$node" 2>/dev/null' TERM INT HUP

status=0
wait "$node" || status=$?
while kill -0 "$node" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for the SuperNode itself
    status=0
    wait "$node" || status=$?
done
wait "$reader" 2>/dev/null

if [ "$status" -ne 0 ] && [ -e "$work/refused" ]; then
    cat >&2 <<EOF
error: the SuperLink refused this node's key ${key:-(none given)}, set by ${setting}: either its public key is
not registered with the coordinator, or another SuperNode with the same key is connected right now. Each
machine needs its own key pair, registered once: never copy a key file (or the volume or disk image holding
it) to a second machine; make this machine's own key and have its public key registered (docs/guide/deployment.md,
"A node's key refused"). If this same node crashed less than about a minute ago, its old session has not
lapsed yet: it is let in once it has (a restart policy retries).
EOF
fi
rm -rf "$work"
exit "$status"
