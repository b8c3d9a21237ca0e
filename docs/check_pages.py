"""Check the built site in a headless browser: nothing overflows on the right, every anchor
resolves.

Not run by CI (it needs a browser); ``make docs-check`` builds the site and runs it. It drives
a Chromium through Playwright (the ``docs-check`` extra) and takes the browser already on the
machine (``apt-get install chromium``; ``--chromium PATH`` for another one), so it needs no
download of Playwright's own browsers.

For every page of ``build/docs`` (the API pages, the guides, the generated source pages), at
each window width of ``--widths``:

* the page does not scroll sideways (``document.documentElement.scrollWidth`` is at most its
  ``clientWidth``);
* no element reaches past the right edge of the content column, or past the right edge of the
  nearest ancestor that clips it; a code block may scroll sideways (a long line stays one
  line), a table or a paragraph may not (its right-hand columns would be out of sight);
* every link to ``#id`` on the page, or to ``page.html#id`` on another page of the site, finds
  an element with that id once the target page has loaded.

Usage: ``python docs/check_pages.py [BUILD_DIR] [--widths 1280,800]``. Exits 1 and lists the
problems when there are any.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urldefrag

ROOT = Path(__file__).resolve().parents[1]

# Run in the page: what sticks out on the right (a list of descriptions), and the page's width.
MEASURE = """() => {
  const doc = document.documentElement;
  const main = document.querySelector('article[role=main]') || document.body;
  const limit = main.getBoundingClientRect().right;
  const clips = (el) =>
      ['auto', 'scroll', 'hidden', 'clip'].includes(getComputedStyle(el).overflowX);
  const name = (el) => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
      (typeof el.className === 'string' && el.className.trim()
       ? '.' + el.className.trim().split(/\\s+/).join('.') : '');
  const SLACK = 10;  // px: furo sets a heading's and a signature's \u00b6 link a few px out
  const out = [];
  for (const el of main.querySelectorAll('*')) {
    const box = el.getBoundingClientRect();
    if (box.width === 0 || box.height === 0) continue;
    let edge = limit, by = 'the content column', scrolls = false;
    for (let up = el.parentElement; up && up !== main; up = up.parentElement) {
      if (clips(up)) {
        edge = up.getBoundingClientRect().right; by = name(up);
        scrolls = ['auto', 'scroll'].includes(getComputedStyle(up).overflowX);
        break;
      }
    }
    if (scrolls) continue;  // inside a box that scrolls sideways (a code block): readable
    if (box.right > edge + SLACK) {
      // report the outermost offender only: skip one whose parent already sticks out
      const p = el.parentElement;
      if (p && p !== main && p.getBoundingClientRect().right > edge + SLACK && !clips(p)) continue;
      out.push(`${name(el)} ends ${Math.round(box.right - edge)}px past ${by}: ` +
               JSON.stringify((el.textContent || '').trim().slice(0, 80)));
    }
  }
  // A box that scrolls sideways is fine for code (a long line stays a line), not for a table
  // or text: there the columns on the right are out of sight.
  for (const el of main.querySelectorAll('*')) {
    if (!clips(el) || el.tagName === 'PRE' || el.closest('pre, div.highlight')) continue;
    if (el.scrollWidth > el.clientWidth + SLACK) {
      out.push(`${name(el)} scrolls sideways (${el.scrollWidth} > ${el.clientWidth} px): ` +
               JSON.stringify((el.textContent || '').trim().slice(0, 80)));
    }
  }
  return {scroll: doc.scrollWidth, client: doc.clientWidth, overflow: out};
}"""

LINKS = """() => Array.from(document.querySelectorAll('a[href*="#"]'),
                           a => a.getAttribute('href'))"""
IDS = """() => Array.from(document.querySelectorAll('[id]'), e => e.id)
  .concat(Array.from(document.querySelectorAll('a[name]'), e => e.name))"""


def pages(build: Path) -> list[Path]:
    return sorted(p for p in build.rglob("*.html") if p.name not in ("search.html",))


def check(build: Path, widths: list[int], chromium: str) -> list[str]:
    from playwright.sync_api import sync_playwright  # the docs-check extra; not a CI dependency

    problems: list[str] = []
    ids: dict[Path, set[str]] = {}
    links: dict[Path, list[str]] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium,
                                     args=["--no-sandbox", "--allow-file-access-from-files"])
        for width in widths:
            page = browser.new_page(viewport={"width": width, "height": 900})
            for path in pages(build):
                page.goto(path.as_uri(), wait_until="load")
                where = f"{path.relative_to(build)} at {width}px"
                found = page.evaluate(MEASURE)
                if found["scroll"] > found["client"]:
                    problems.append(f"{where}: the page scrolls sideways "
                                    f"({found['scroll']} > {found['client']} px)")
                problems += [f"{where}: {item}" for item in found["overflow"]]
                if path not in ids:
                    ids[path] = set(page.evaluate(IDS))
                    links[path] = page.evaluate(LINKS)
            page.close()
        browser.close()
    for path, hrefs in links.items():
        for href in hrefs:
            if "://" in href or href.startswith("mailto:"):
                continue
            target, fragment = urldefrag(href)
            fragment = unquote(fragment)
            page = (path.parent / target).resolve() if target else path
            if not fragment:
                continue
            if page not in ids:
                problems.append(f"{path.relative_to(build)}: {href}: no such page")
            elif fragment not in ids[page]:
                problems.append(f"{path.relative_to(build)}: {href}: no element with id "
                                f"{fragment!r} on {page.relative_to(build)}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", nargs="?", default=str(ROOT / "build" / "docs"))
    parser.add_argument("--widths", default="1280,800",
                        help="window widths in CSS pixels, comma separated")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args(argv)
    build = Path(args.build).resolve()
    if not (build / "index.html").is_file():
        print(f"check_pages: no site in {build}; build it first (make docs)", file=sys.stderr)
        return 2
    problems = check(build, [int(w) for w in args.widths.split(",")], args.chromium)
    for problem in problems:
        print(problem)
    print(f"check_pages: {len(pages(build))} pages, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
