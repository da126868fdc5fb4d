#!/usr/bin/env bash
# System libraries the Python packages need and pip cannot install:
# - GLib for the libcachesim wheel (replay's libCacheSim peers).
# - A Java runtime and Maven for the Kafka broker the tests start.
# - A C compiler: LightGBM models are compiled to native code to score
#   (predictor/compiled_trees.py; without one, LightGBM's own predictor scores).
set -euo pipefail
need=()
ldconfig -p 2>/dev/null | grep -q 'libglib-2.0.so.0' || need+=(libglib2.0-0)
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need+=(maven)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing system packages: ${need[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
