#!/bin/bash
# Reproduce, on any Linux machine, a host whose name resolves nowhere and whose DNS resolver does
# not answer (an isolated VM), and time gloo worlds there with and without the loopback binding
# (scripts/diagnose_network.py). Everything happens in private network, mount and UTS namespaces:
# the host name, /etc/hosts and /etc/resolv.conf are changed only inside them, and no packet
# leaves the private namespace's loopback interface. Needs root (or unprivileged user namespaces:
# prefix the unshare call with --user --map-root-user).
#
#   scripts/reproduce_slow_resolver.sh [CASE] [--groups N]
#
# CASE: unanswered-dns (default): the host name is in no hosts file, the resolver drops queries;
#       hosted-name: the same resolver, but the host name is in /etc/hosts (the usual fix);
#       unbindable: the host name resolves to an address no interface has;
#       local-alias: the host name resolves to a non-loopback address of this host.
set -euo pipefail

if [[ "${1:-}" != --inside ]]; then
    repo=$(cd "$(dirname "$0")/.." && pwd)
    exec unshare --net --mount --uts --propagation private "$0" --inside "$repo" "$@"
fi
shift
repo=$1
shift
case=unanswered-dns
if [[ $# -gt 0 && $1 != --* ]]; then
    case=$1
    shift
fi

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
resolver=10.255.255.53
ip link set lo up
hostname ghost
printf 'nameserver %s\noptions timeout:5 attempts:2\n' "$resolver" > "$work/resolv.conf"
case $case in
    unanswered-dns) printf '127.0.0.1 localhost\n' > "$work/hosts" ;;
    hosted-name)    printf '127.0.0.1 localhost ghost\n' > "$work/hosts" ;;
    unbindable)     printf '127.0.0.1 localhost\n10.77.0.1 ghost\n' > "$work/hosts" ;;
    local-alias)    printf '127.0.0.1 localhost\n10.77.0.1 ghost\n' > "$work/hosts"
                    ip addr add 10.77.0.1/32 dev lo ;;
    *) echo "unknown case $case (unanswered-dns, hosted-name, unbindable, local-alias)" >&2; exit 2 ;;
esac
# A resolver that reads queries and never answers (glibc then waits timeout x attempts = 10 s).
ip addr add "$resolver/32" dev lo
python -c '
import socket, sys
server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
server.bind((sys.argv[1], 53))
while True:
    server.recvfrom(4096)
' "$resolver" &
mount --bind "$work/hosts" /etc/hosts
mount --bind "$work/resolv.conf" /etc/resolv.conf

echo "case $case: host name ghost, /etc/hosts: $(tr '\n' ';' < /etc/hosts) resolver $resolver (drops queries)"
cd "$repo"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python scripts/diagnose_network.py "$@"
