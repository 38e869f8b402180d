"""Make a published asv site work without internet access.

asv 0.6's index.html loads jQuery, flot (with its time, selection and categories
plugins), flot-orderBars, stupidtable, blueimp-md5 and bootstrap from CDNs. On a
machine that cannot reach them (this project's CI machines, a laptop offline) the
site shows only asv's "Can not determine continental origin of swallow" page.
This script points those tags at local copies under HTML_DIR/vendor/, taken from
asv 0.4.2's source distribution, which shipped them: the same jQuery 3.3.1 (byte
for byte), flot 0.8.3 and plugins that asv 0.6 loads, and bootstrap 3.1.0 for
3.1.1. `make setup` downloads that sdist from PyPI into .venv/asv-www/ (--download;
checked against its sha256 on PyPI).

A CDN address this script does not know (a newer asv) is an error, not skipped.

    python tools/offline_site.py --download [--sdist PATH]
    python tools/offline_site.py [HTML_DIR] [--sdist PATH]
"""

import argparse
import hashlib
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SDIST = REPO / ".venv" / "asv-www" / "asv-0.4.2.tar.gz"
SDIST_URL = ("https://files.pythonhosted.org/packages/46/c7/"
             "a5144ca1409a4a1a8212ebdbe4a78df7ebb3758ff44dfe97c881fc08927e/asv-0.4.2.tar.gz")
SDIST_SHA256 = "9134f56b7a2f465420f17b5bb0dee16047a70f01029c996b7ab3f197de2d0779"
VENDOR_IN_SDIST = "asv-0.4.2/asv/www/vendor/"

# end of the CDN address in asv 0.6's index.html -> file in asv 0.4.2's www/vendor
LOCAL_COPY = {
    "/jquery-3.3.1.min.js": "jquery-3.3.1.min.js",
    "/flot/0.8.3/jquery.flot.min.js": "jquery.flot-0.8.3.min.js",
    "/flot/0.8.3/jquery.flot.time.min.js": "jquery.flot-0.8.3.time.min.js",
    "/flot/0.8.3/jquery.flot.selection.min.js": "jquery.flot-0.8.3.selection.min.js",
    "/flot/0.8.3/jquery.flot.categories.min.js": "jquery.flot-0.8.3.categories.min.js",
    "/jquery.flot.orderBars.js": "jquery.flot.orderBars.js",
    "/stupidtable/1.0.1/stupidtable.min.js": "stupidtable.js",
    "/blueimp-md5/2.19.0/js/md5.min.js": "md5.js",
    "/bootstrap@3.1.1/dist/js/bootstrap.min.js": "bootstrap-3.1.0.min.js",
    "/bootstrap@3.1.1/dist/css/bootstrap.min.css": "bootstrap-3.1.0.min.css",
}

TAG = re.compile(r"<(?:script|link)\b[^>]*>")
REMOTE = re.compile(r'\b(src|href)="(https?://[^"]+)"')
# attributes that only make sense for the CDN copy (subresource integrity of its bytes)
CDN_ONLY = re.compile(r'\s+(?:integrity|crossorigin|referrerpolicy)(?:="[^"]*")?')


def local_copy(url: str) -> str:
    for suffix, name in LOCAL_COPY.items():
        if url.endswith(suffix):
            return name
    raise SystemExit(f"offline_site: no local copy of {url} (asv's site now loads something new: "
                     "add it to LOCAL_COPY)")


def download(sdist: Path = DEFAULT_SDIST) -> None:
    """Fetch asv 0.4.2's sdist (not with pip: pip would run its 2019 setup.py)."""
    if sdist.is_file() and hashlib.sha256(sdist.read_bytes()).hexdigest() == SDIST_SHA256:
        return
    with urllib.request.urlopen(SDIST_URL, timeout=60) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"offline_site: {SDIST_URL} has sha256 {digest}, expected {SDIST_SHA256}")
    sdist.parent.mkdir(parents=True, exist_ok=True)
    sdist.write_bytes(data)


def make_offline(html_dir: Path, sdist: Path = DEFAULT_SDIST) -> list[str]:
    """Rewrite html_dir/index.html to load vendor/ copies; returns the files copied."""
    index = html_dir / "index.html"
    if not index.is_file():
        raise SystemExit(f"offline_site: {index} does not exist: run `asv publish` first")
    if not sdist.is_file():
        raise SystemExit(f"offline_site: {sdist} is missing: run `make setup` (it downloads asv 0.4.2's sdist)")
    needed = set()

    def rewrite(tag: re.Match) -> str:
        text = tag.group(0)
        remote = REMOTE.search(text)
        if remote is None:
            return text
        name = local_copy(remote.group(2))
        needed.add(name)
        text = text.replace(remote.group(0), f'{remote.group(1)}="vendor/{name}"')
        return CDN_ONLY.sub("", text)

    html = TAG.sub(rewrite, index.read_text())
    vendor = html_dir / "vendor"
    vendor.mkdir(exist_ok=True)
    with tarfile.open(sdist) as tar:
        for name in sorted(needed):
            member = tar.extractfile(VENDOR_IN_SDIST + name)
            (vendor / name).write_bytes(member.read())
    index.write_text(html)
    return sorted(needed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html_dir", nargs="?", type=Path, default=REPO / ".asv" / "html")
    parser.add_argument("--sdist", type=Path, default=DEFAULT_SDIST)
    parser.add_argument("--download", action="store_true", help="fetch the sdist from PyPI and stop")
    args = parser.parse_args(argv)
    if args.download:
        download(args.sdist)
        return 0
    copied = make_offline(args.html_dir, args.sdist)
    print(f"{args.html_dir}/index.html now loads {len(copied)} local files from vendor/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
