#!/usr/bin/env bash
# Copy the chat page's three browser libraries into the package at pinned versions, with their licences.
# They are served by `minfer serve` itself (src/minfer/server/page/vendor/): the page never reaches a CDN.
#
#   marked     - markdown to HTML            (MIT)
#   DOMPurify  - sanitizes that HTML         (Apache-2.0 or MPL-2.0)
#   highlight.js (the @highlightjs/cdn-assets npm build: common languages) - code highlighting (BSD-3-Clause)
#
# Run from the repository root: bash scripts/vendor_page_libs.sh   (needs npm; only the npm registry is used)
set -euo pipefail

MARKED=15.0.12
DOMPURIFY=3.2.6
HIGHLIGHT=11.11.1

dest="src/minfer/server/page/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"

( cd "$work" && npm pack --silent "marked@$MARKED" "dompurify@$DOMPURIFY" "@highlightjs/cdn-assets@$HIGHLIGHT" >/dev/null )

unpack() { mkdir -p "$work/$1" && tar -xzf "$work/$2" -C "$work/$1" --strip-components=1; }
unpack marked "marked-$MARKED.tgz"
unpack dompurify "dompurify-$DOMPURIFY.tgz"
unpack hljs "highlightjs-cdn-assets-$HIGHLIGHT.tgz"

cp "$work/marked/lib/marked.umd.js" "$dest/marked.umd.js"
cp "$work/marked/LICENSE.md" "$dest/marked.LICENSE.md"
cp "$work/dompurify/dist/purify.min.js" "$dest/purify.min.js"
cp "$work/dompurify/LICENSE" "$dest/dompurify.LICENSE"
cp "$work/hljs/highlight.min.js" "$dest/highlight.min.js"
cp "$work/hljs/styles/github.min.css" "$dest/highlight-github.min.css"
cp "$work/hljs/LICENSE" "$dest/highlight.js.LICENSE"
# a source map comment would make the browser ask the server for a file that is not shipped
sed -i '/^\/\/# sourceMappingURL=/d' "$dest/marked.umd.js" "$dest/purify.min.js"

cat > "$dest/VERSIONS" <<EOV
marked $MARKED (npm: marked)
dompurify $DOMPURIFY (npm: dompurify)
highlight.js $HIGHLIGHT (npm: @highlightjs/cdn-assets)
EOV
echo "vendored into $dest:"; ls -l "$dest"
