"""Check that every relative link ``](path)`` in README.md and docs/*.md points to an existing file.

Run from the repository root: ``python3 docs/check_links.py``. Links into a Markdown file with a
``#anchor`` must also name one of its headings (GitHub's slugs). Exit status 1 if a link is broken.
"""

import pathlib
import re
import sys


def slug(heading: str) -> str:
    heading = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return heading.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


def main() -> int:
    broken = checked = 0
    files = [pathlib.Path("README.md"), *sorted(pathlib.Path("docs").glob("*.md"))]
    for md in files:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
                continue
            checked += 1
            path, _, anchor = link.partition("#")
            target = md.parent / path if path else md
            if not target.exists():
                print(f"{md}: missing {link}")
                broken += 1
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                print(f"{md}: missing heading {link}")
                broken += 1
    print(f"{checked} relative links checked, {broken} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
