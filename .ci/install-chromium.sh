#!/usr/bin/env bash
# Debian's chromium for the dashboard's browser test (tests/api/test_dashboard.py); no browser download
# from anywhere else. Does nothing when chromium is already installed. Needs root and apt.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium  # its recommends bring the fonts pages render with
