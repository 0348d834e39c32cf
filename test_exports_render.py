"""md and qmd exports stay text wherever they are rendered (issue 36, point 1).

Hostile transcripts go into a real store through the command line's import, come out through its
md and qmd exports, and are rendered as users render them: pandoc (`pandoc -s`, its own Markdown
as Quarto reads it, CommonMark with and without extensions, GitHub's), then loaded in headless
Chromium beside a beacon server on 127.0.0.1 that any script, image or stylesheet would call.
Quarto itself is not a Debian package: its and knitr's own scans for code are checked on the raw
files, and a real `quarto render` runs where quarto is installed. Debian's pandoc and chromium are
installed by the setup when missing and this user may; each test says why it skipped otherwise.
"""

import concurrent.futures
import html.parser
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest
from pathlib import Path

from hermes_state_export_formats import markdown_text
from test_support import REPO

# BEACON is replaced by the beacon server's address; PWNED is what a payload sets the title to.
ATTACKS = [
    ("a YAML block whose \\x3c escapes pass HTML escaping",
     "---\nheader-includes: \"\\x3cscript\\x3edocument.title='PWNED';"
     "fetch('BEACON/yaml')\\x3c/script\\x3e\"\n---"),
    ("raw HTML through a raw attribute", "`<script>document.title='PWNED'</script>`{=html}"),
    ("a raw HTML block", "```{=html}\n<script>fetch('BEACON/raw-block')</script>\n```"),
    ("an event handler attribute", "[hover](#){onmouseover=\"document.title='PWNED'\"}"),
    ("a javascript: link", "[x](javascript:document.title='PWNED')"),
    ("a javascript: autolink", "<javascript:document.title='PWNED'>"),
    ("a reference link to javascript:", "[ref]\n\n[ref]: javascript:alert(1)"),
    ("a remote image", "![](BEACON/image.png)"),
    ("an img tag", "<img src=\"BEACON/img.png\" onerror=\"document.title='PWNED'\">"),
    ("a script tag", "<script>document.title='PWNED'</script>"),
    ("a style tag", "<style>body{background:url(BEACON/style.png)}</style>"),
    ("a fenced div with a handler", "::: {onclick=\"document.title='PWNED'\"}\nclick\n:::"),
    ("a span with a style", "[x]{style=\"background:url(BEACON/span.png)\"}"),
    ("an HTML comment", "before <!-- hidden --> after"),
    ("math", "$$\\href{javascript:alert(1)}{x}$$ and $y$"),
    ("raw TeX", "\\begin{document}\\input{/etc/passwd}\\end{document}"),
    ("a Quarto python cell", "```{python}\nopen('/tmp/pwned-by-export', 'w')\n```"),
    ("Quarto inline python", "`{python} __import__('os').getcwd()`"),
    ("knitr inline R", "`r Sys.time()`"),
    ("Quarto shortcodes", "{{< env HOME >}} {{< include /etc/passwd >}} {{< meta title >}}"),
    ("entities", "&lt;b&gt; &amp; &#60;script&#62;"),
    ("smart punctuation", "it's \"quoted\" -- dash --- em ... ellipsis"),
    ("headings, lists and quotes", "# not a heading\n1. not a list\n- nor this\n> nor a quote"),
    ("an indented code block", "    four spaces\n\tand a tab"),
    ("setext headings", "title\n===\nsub\n---"),
    ("a pipe table", "| a | b |\n|---|---|\n| 1 | 2 |"),
    ("footnotes and citations", "[^1] @doe99 [@doe99]\n\n[^1]: a note"),
    ("emphasis and friends", "*a* _b_ **c** ~~d~~ ^e^ ~f~ <u>g</u>"),
    ("backslashes", "a line ending in a backslash\\\nC:\\path\\ and \\\\ two"),
    ("a carriage return", "first\rsecond"),
    ("a line block and a definition", "| line block\nterm\n:   definition"),
    ("a bare URL", "www.attacker.example and https://attacker.example/x"),
]
PLACES = ("title", "session id", "source", "system prompt", "user message", "tool output",
          "tool name")
# pandoc's readers: its own Markdown (Quarto's), CommonMark with extensions, plain CommonMark,
# GitHub's. Plain CommonMark has no front matter: it reads that block as a heading of text. A qmd
# file is read as Quarto reads it, with pandoc's Markdown.
READERS = {"md": ("markdown", "commonmark_x", "commonmark", "gfm"), "qmd": ("markdown",)}
ELEMENTS_REFUSED = {"script", "img", "iframe", "frame", "object", "embed", "link", "audio", "video",
                    "source", "svg", "math", "form", "input", "button", "base", "image", "track"}
URL_ATTRIBUTES = {"href", "src", "action", "formaction", "xlink:href", "data", "poster", "srcset",
                  "background", "ping"}


def installed(command, package):
    """None when `command` runs here (installing Debian's `package` if this user may), else why
    not."""
    if shutil.which(command):
        return None
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{command} is missing and this user cannot install Debian's {package}"
    try:
        result = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", package],
                                capture_output=True, text=True, timeout=1200,
                                env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    except subprocess.TimeoutExpired:
        return f"apt-get install {package} took more than 20 minutes"
    if shutil.which(command):
        return None
    return f"apt-get install {package} failed: {(result.stderr or result.stdout)[-300:]!r}"


def collapsed(text):
    return " ".join(text.split())


class Beacon(http.server.ThreadingHTTPServer):
    """Serves the rendered pages from `folder`; records every other request (a beacon) and takes
    the harness's results by POST."""

    def __init__(self, folder):
        self.folder, self.hits, self.results = folder, [], threading.Event()
        self.posted = None
        super().__init__(("127.0.0.1", 0), BeaconHandler)


class BeaconHandler(http.server.BaseHTTPRequestHandler):

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.server.folder / self.path.lstrip("/").split("?")[0]
        if self.path.startswith("/pages/") and path.is_file():
            body = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path != "/favicon.ico":  # the browser's own request
            self.server.hits.append(self.path)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        self.server.posted = json.loads(self.rfile.read(length))
        self.send_response(204)
        self.end_headers()
        self.server.results.set()

    def log_message(self, *args):
        pass


# Loads every page in an iframe of its own origin, then reports what a reader of each sees: the
# title, the visible text (innerText), elements and attributes that run or load something.
HARNESS = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>harness</title></head><body>
<script>
const pages = PAGES;
const refused = new Set(REFUSED), urls = new Set(URLS);
async function inspect(page) {
  const frame = document.createElement("iframe");
  const loaded = new Promise(resolve => frame.onload = resolve);
  frame.src = page;
  document.body.appendChild(frame);
  await loaded;
  await new Promise(resolve => setTimeout(resolve, 300));
  const doc = frame.contentDocument, found = [];
  for (const el of doc.querySelectorAll("*")) {
    const tag = el.tagName.toLowerCase();
    if (refused.has(tag)) found.push("element " + tag);
    for (const attr of el.attributes) {
      const name = attr.name.toLowerCase(), value = attr.value.trim().toLowerCase();
      if (name.startsWith("on")) found.push("handler " + tag + " " + name);
      if (urls.has(name) && /^(javascript|data|vbscript):/.test(value.replace(/\\s/g, "")))
        found.push("url " + tag + " " + name + "=" + value);
      if (name === "style" && value.includes("url(")) found.push("style " + tag);
    }
  }
  const result = {title: doc.title, text: doc.body.innerText, found: found};
  frame.remove();
  return result;
}
(async () => {
  const results = {};
  for (let at = 0; at < pages.length; at += 8) {  // eight frames at a time
    const batch = pages.slice(at, at + 8);
    const seen = await Promise.all(batch.map(inspect));
    batch.forEach((page, i) => { results[page] = seen[i]; });
  }
  await fetch("/results", {method: "POST", body: JSON.stringify(results)});
})();
</script></body></html>
"""


class PageText(html.parser.HTMLParser):
    """The <title> of a page as pandoc wrote it."""

    def __init__(self):
        super().__init__()
        self.title, self._in_title = "", False

    def handle_starttag(self, tag, attrs):
        self._in_title = tag == "title"

    def handle_endtag(self, tag):
        self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


class Markup(html.parser.HTMLParser):
    """Elements and attributes of a page that run or load something, as found[]."""

    def __init__(self):
        super().__init__()
        self.found = []

    def handle_starttag(self, tag, attrs):
        if tag in ELEMENTS_REFUSED:
            self.found.append(f"element {tag}")
        for name, value in attrs:
            value = "".join((value or "").split()).lower()
            loads = name in URL_ATTRIBUTES and (value.startswith(("javascript:", "data:"))
                                                or "127.0.0.1" in value)
            if name.startswith("on") or loads or name == "style" and "url(" in value:
                self.found.append(f"{tag} {name}={value}")


def static_title(page):
    parser = PageText()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.title


class RenderedExports(unittest.TestCase):
    """One store of hostile sessions, exported once per format, rendered once per reader."""

    @classmethod
    def setUpClass(cls):
        cls.pandoc_missing = installed("pandoc", "pandoc")
        cls.tmp = Path(tempfile.mkdtemp(prefix="hermes-render-"))
        cls.addClassCleanup(shutil.rmtree, cls.tmp, True)
        cls.beacon = Beacon(cls.tmp)
        threading.Thread(target=cls.beacon.serve_forever, daemon=True).start()
        cls.addClassCleanup(cls.beacon.server_close)
        cls.addClassCleanup(cls.beacon.shutdown)
        address = f"http://127.0.0.1:{cls.beacon.server_address[1]}"
        cls.attacks = [(name, text.replace("BEACON", address)) for name, text in ATTACKS]
        cls.sessions = cls.export_attacks()
        cls.pages = {} if cls.pandoc_missing else cls.render_all()

    @classmethod
    def run_cli(cls, *args, stdin=None):
        env = dict(os.environ, HERMES_HOME=str(cls.tmp / "home"), PYTHONPATH=str(REPO))
        result = subprocess.run([sys.executable, "-m", "hermes_state", *map(str, args)],
                                capture_output=True, text=True, env=env, cwd=cls.tmp,
                                timeout=120, input=stdin)
        if result.returncode:
            raise AssertionError(f"{args[0]} failed: {result.stderr}")
        return result

    @classmethod
    def export_attacks(cls):
        """{(fmt, attack index): (export dict, file)} through import and export on the command
        line."""
        lines = []
        for index, (name, text) in enumerate(cls.attacks):
            lines.append(json.dumps({
                "id": f"{index}:{text}", "source": text, "model": text, "cwd": text, "title": text,
                "system_prompt": text, "started_at": 1700000000 + index,
                "messages": [
                    {"role": "user", "content": text, "timestamp": 1700000001 + index},
                    {"role": "assistant", "content": None, "timestamp": 1700000002 + index,
                     "tool_calls": [{"id": "c1", "type": "function",
                                     "function": {"name": text, "arguments": text}}]},
                    {"role": "tool", "content": text, "tool_name": text, "tool_call_id": "c1",
                     "timestamp": 1700000003 + index}]}))
        (cls.tmp / "attacks.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        db = cls.tmp / "home" / "state.db"
        cls.run_cli("--db", db, "import", cls.tmp / "attacks.jsonl")
        cls.run_cli("--db", db, "export", "--format", "jsonl", cls.tmp / "attacks-out.jsonl")
        exports = {e["id"]: e for e in map(json.loads, (cls.tmp / "attacks-out.jsonl")
                                           .read_text(encoding="utf-8").splitlines())}
        found = {}
        for fmt in ("md", "qmd"):
            cls.run_cli("--db", db, "export", "--format", fmt, cls.tmp / fmt)
            manifest = (cls.tmp / fmt / "manifest.jsonl").read_text(encoding="utf-8")
            for entry in map(json.loads, manifest.splitlines()):
                index = int(entry["session_id"].split(":", 1)[0])
                found[fmt, index] = (exports[entry["session_id"]], cls.tmp / fmt / entry["file"])
        return found

    @classmethod
    def render_all(cls):
        """{(fmt, index, reader): rendered page} with pandoc's own HTML5 template, plus a list of
        our front matter values where pandoc puts the body (pandoc renders no other key)."""
        template = subprocess.run(["pandoc", "-D", "html5"], capture_output=True, text=True,
                                  check=True).stdout
        keys = ("session_id", "source", "model", "cwd")
        listing = "".join(f'<p class="front">{key}: ${key}$</p>\n' for key in keys)
        (cls.tmp / "template.html5").write_text(template.replace("$body$", listing + "$body$"),
                                                encoding="utf-8")
        pages = {(fmt, index, reader): (source, cls.tmp / "pages" / f"{fmt}-{index}-{reader}.html")
                 for (fmt, index), (_export, source) in cls.sessions.items()
                 for reader in READERS[fmt]}
        (cls.tmp / "pages").mkdir()

        def render(key):
            source, page = pages[key]
            subprocess.run(["pandoc", "-s", "-f", key[2], "-t", "html5",
                            "--template", cls.tmp / "template.html5",
                            "--metadata", "pagetitle=export", source, "-o", page],
                           check=True, capture_output=True, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 160 runs of pandoc
            list(pool.map(render, pages))
        return {key: page for key, (_source, page) in pages.items()}

    def require_pandoc(self):
        if self.pandoc_missing:
            self.skipTest(self.pandoc_missing)

    def browse(self):
        """What Chromium shows of every page: {page name: {title, text, found}}; once a run."""
        cls = type(self)
        if getattr(cls, "seen", None) is not None:
            return cls.seen
        self.require_pandoc()
        missing = installed("chromium", "chromium")
        if missing:
            self.skipTest(missing)
        names = sorted(page.name for page in self.pages.values())
        harness = (HARNESS.replace("PAGES", json.dumps([f"/pages/{n}" for n in names]))
                   .replace("REFUSED", json.dumps(sorted(ELEMENTS_REFUSED)))
                   .replace("URLS", json.dumps(sorted(URL_ATTRIBUTES))))
        (self.tmp / "pages" / "harness.html").write_text(harness, encoding="utf-8")
        url = f"http://127.0.0.1:{self.beacon.server_address[1]}/pages/harness.html"
        browser = subprocess.Popen(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={self.tmp / 'chromium-profile'}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            done = self.beacon.results.wait(timeout=300)
        finally:
            browser.terminate()
            try:
                browser.wait(timeout=30)
            except subprocess.TimeoutExpired:
                browser.kill()
                browser.wait()
        self.assertTrue(done, "Chromium reported nothing within 300 s")
        cls.seen = {name.rsplit("/", 1)[1]: seen for name, seen in self.beacon.posted.items()}
        return cls.seen

    # -- the attacks, one row each -------------------------------------------------------------

    def test_no_script_runs_no_handler_link_or_load_survives_in_chromium(self):
        seen = self.browse()
        self.assertEqual(len(seen), len(self.pages))
        for (fmt, index, reader), page in sorted(self.pages.items()):
            with self.subTest(fmt=fmt, reader=reader, attack=self.attacks[index][0]):
                shown = seen[page.name]
                self.assertEqual(shown["title"], static_title(page))  # no script changed it
                self.assertNotIn("PWNED", shown["title"])
                self.assertEqual(shown["found"], [])
        self.assertEqual(self.beacon.hits, [], "a page loaded or called out")

    def test_every_attack_shows_as_its_own_text_in_every_place(self):
        seen = self.browse()
        for (fmt, index, reader), page in sorted(self.pages.items()):
            export, _source = self.sessions[fmt, index]
            text = collapsed(seen[page.name]["text"])
            places = {"title": export["title"], "session id": export["id"],
                      "system prompt": export["system_prompt"],
                      "user message": export["messages"][0]["content"],
                      "tool output": export["messages"][2]["content"],
                      "tool name": export["messages"][2]["tool_name"]}
            if reader != "commonmark":  # front matter needs an extension plain CommonMark lacks
                places.update({f"front matter {key}": f"{key}: {export[key]}"
                               for key in ("source", "model", "cwd")})
            for place, value in places.items():
                with self.subTest(fmt=fmt, reader=reader, attack=self.attacks[index][0],
                                  place=place):
                    self.assertIn(collapsed(value), text)

    def test_pandoc_writes_no_markup_of_a_store_string(self):
        # The same checks without a browser, on what pandoc wrote.
        self.require_pandoc()
        for (fmt, index, reader), page in sorted(self.pages.items()):
            with self.subTest(fmt=fmt, reader=reader, attack=self.attacks[index][0]):
                parser = Markup()
                parser.feed(page.read_text(encoding="utf-8"))
                self.assertEqual(parser.found, [])

    def test_tool_calls_come_back_exactly_from_their_json_fence(self):
        for (fmt, index), (export, source) in sorted(self.sessions.items()):
            with self.subTest(fmt=fmt, attack=self.attacks[index][0]):
                text = source.read_text(encoding="utf-8")
                fence = text.split("#### Tool calls\n\n```json\n", 1)[1].split("\n```\n", 1)[0]
                self.assertEqual(json.loads(fence), export["messages"][1]["tool_calls"])

    # -- Quarto and knitr ----------------------------------------------------------------------

    def test_no_cell_inline_code_or_shortcode_quarto_or_knitr_would_run(self):
        # Their own scans of the raw file: a cell opens on a backtick fence with {engine}, inline
        # code is `{engine} x` or `r x`, a shortcode {{< >}}; each needs a backtick or "{{<".
        cell = re.compile(r"^[\t >]*```+\s*\{", re.M)
        inline = re.compile(r"`(r[ #]|\{)")
        for (fmt, index), (_export, source) in sorted(self.sessions.items()):
            text = source.read_text(encoding="utf-8")
            with self.subTest(fmt=fmt, attack=self.attacks[index][0]):
                self.assertIsNone(cell.search(text))
                self.assertIsNone(inline.search(text))
                self.assertNotIn("{{<", text)
                # Every backtick left is ours: code spans of counts and digests, the JSON fence.
                self.assertEqual(re.sub(r"`[0-9a-f]+`|```json\n|\n```\n", "", text).count("`"), 0)
                front = text.split("\n---\n", 1)[0] + "\n"
                if fmt == "qmd":
                    self.assertIn("\nengine: markdown\nexecute:\n  enabled: false\n", front)

    def test_quarto_renders_the_qmd_as_text(self):
        if not shutil.which("quarto"):
            self.skipTest("Quarto is not packaged by Debian; install it from quarto.org to run "
                          "this (the raw-file checks above stand in for it)")
        for (fmt, index), (export, source) in sorted(self.sessions.items()):
            if fmt != "qmd":
                continue
            with self.subTest(attack=self.attacks[index][0]):
                copy = self.tmp / "quarto" / f"attack-{index}.qmd"
                copy.parent.mkdir(exist_ok=True)
                shutil.copyfile(source, copy)
                result = subprocess.run(["quarto", "render", copy, "--to", "html"],
                                        capture_output=True, text=True, timeout=300)
                self.assertEqual(result.returncode, 0, result.stderr[-2000:])
                page = copy.with_suffix(".html").read_text(encoding="utf-8")
                self.assertNotIn("<script>document.title", page)
                self.assertFalse(Path("/tmp/pwned-by-export").exists())


class MarkdownText(unittest.TestCase):
    """markdown_text alone: what pandoc makes of each attack in a paragraph."""

    def test_each_attack_renders_as_itself_in_pandoc_markdown(self):
        missing = installed("pandoc", "pandoc")
        if missing:
            self.skipTest(missing)
        for name, text in ATTACKS:
            for reader in ("markdown", "commonmark"):
                with self.subTest(attack=name, reader=reader):
                    result = subprocess.run(["pandoc", "-f", reader, "-t", "plain", "--wrap=none"],
                                            input=markdown_text(text), capture_output=True,
                                            text=True, check=True, timeout=60)
                    self.assertEqual(collapsed(result.stdout), collapsed(text))


if __name__ == "__main__":
    unittest.main()
