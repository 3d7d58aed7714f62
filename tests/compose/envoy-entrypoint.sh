#!/bin/sh
# The official Envoy image's entrypoint, as far as the compose file uses
# it: flags alone are Envoy's, and Envoy does not run as root.
set -e
if [ "${1#-}" != "$1" ]; then
    set -- envoy "$@"
fi
if [ "$1" = envoy ] && [ "${ENVOY_UID:-101}" != 0 ] && [ "$(id -u)" = 0 ]; then
    exec setpriv --reuid="${ENVOY_UID:-101}" --regid="${ENVOY_GID:-101}" --clear-groups "$@"
fi
exec "$@"
