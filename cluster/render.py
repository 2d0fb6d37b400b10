"""Embeds the GPU Serve config into the KubeRay RayService as its serveConfigV2.

    python -m cluster.render           # rewrite cluster/kuberay/rayservice.yaml
    python -m cluster.render --check   # exit 1 if it is out of date

configs/gpu_llama3_70b.yaml stays the one copy of the Serve config: the block scalar under
`serveConfigV2: |` is replaced by that file's text, verbatim (comments included), and the
rest of the manifest is left as written.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "configs" / "gpu_llama3_70b.yaml"
RAYSERVICE = ROOT / "cluster" / "kuberay" / "rayservice.yaml"

_KEY = re.compile(r"^(?P<indent>\s*)serveConfigV2:\s*\|[-+]?\s*$")


def render(manifest_text: str, serve_config_text: str) -> str:
    """The manifest with its serveConfigV2 block replaced by `serve_config_text`."""
    lines = manifest_text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        match = _KEY.match(line.rstrip("\n"))
        if match:
            break
    else:
        raise ValueError("no `serveConfigV2: |` block in the manifest")
    indent = len(match["indent"])
    end = i + 1
    # The block runs while lines are blank or indented deeper than the key.
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip(" ")) > indent
    ):
        end += 1
    while end > i + 1 and not lines[end - 1].strip():  # keep blank lines after the block
        end -= 1
    pad = " " * (indent + 2)
    body = [
        (pad + text if text.strip() else "\n")
        for text in serve_config_text.rstrip("\n").splitlines(keepends=True)
    ]
    body[-1] = body[-1].rstrip("\n") + "\n"
    return "".join(lines[: i + 1] + body + lines[end:])


def rendered() -> str:
    return render(RAYSERVICE.read_text(), SERVE_CONFIG.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.render", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if out of date")
    args = parser.parse_args(argv)
    new = rendered()
    if new == RAYSERVICE.read_text():
        print(f"{RAYSERVICE.relative_to(ROOT)} is up to date")
        return 0
    if args.check:
        print(f"{RAYSERVICE.relative_to(ROOT)} is out of date: run python -m cluster.render", file=sys.stderr)
        return 1
    RAYSERVICE.write_text(new)
    print(f"wrote {RAYSERVICE.relative_to(ROOT)} (serveConfigV2 from {SERVE_CONFIG.relative_to(ROOT)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
