"""The chat page and the dashboard (``GET /chat``, ``GET /dashboard``) without a browser: the
pages' promise to reach nothing beyond the server they came from. Clicked through in headless
Chromium: tests/system/test_chat_page.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from testing.servers import make_settings


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> TestClient:
    """The app without its lifespan: the pages need no engine, database or log."""
    from server.app import create_app

    settings = make_settings(tmp_path_factory.mktemp("pages"))
    return TestClient(create_app(settings, engine=SimpleNamespace(), watch_policy=False))


# Where a page could name another origin: attributes that load or navigate, CSS imports and
# url(), and the scripts' fetch() calls.
URL_SPOTS = re.compile(
    r"""\b(?:src|href|action|formaction)\s*=\s*["']?([^"'\s>]*)"""
    r"""|@import\s+["']?([^"';\s]*)"""
    r"""|url\(\s*["']?([^"')\s]*)"""
    r"""|fetch\(\s*["'`]([^"'`]*)""",
    re.IGNORECASE,
)


def foreign_urls(html: str) -> list[str]:
    """Every absolute URL in ``html`` (a scheme, or ``//host``), and every URL a page would load
    or call that is not a relative path of its own server."""
    out = re.findall(r"\b[a-z][a-z0-9+.-]*://[^\s\"'`<>]*", html, re.IGNORECASE)
    for groups in URL_SPOTS.findall(html):
        url = "".join(groups)  # the one group that matched
        if url.startswith("//") or re.match(r"[a-z][a-z0-9+.-]*:", url, re.IGNORECASE):
            out.append(url)
    return out


def test_foreign_urls_finds_what_would_leave_the_server():
    html = (
        '<script src="https://cdn.example/x.js"></script><a href=//evil.example/>x</a>'
        "<style>@import 'http://a/b.css'; p { background: url(data:image/png;base64,AA) }</style>"
        '<script>fetch("v1/models"); fetch(`wss://x`); // a comment, not a URL</script>'
        '<a href="dashboard">d</a><img src="img/p.png">'
    )
    assert foreign_urls(html) == [
        "https://cdn.example/x.js",
        "http://a/b.css",
        "wss://x",
        "https://cdn.example/x.js",
        "//evil.example/",
        "http://a/b.css",
        "data:image/png;base64,AA",
        "wss://x",
    ]


@pytest.mark.parametrize("path", ["/chat", "/dashboard"])
def test_pages_reach_nothing_beyond_their_server(pages, path):
    r = pages.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert foreign_urls(r.text) == []
    # Scripts and styles inline: no file of any origin to fetch.
    assert not re.search(r"<script[^>]*\bsrc\b|<link\b", r.text, re.IGNORECASE)


def test_chat_page_and_dashboard_link_each_other(pages):
    assert '<a href="dashboard">' in pages.get("/chat").text
    assert '<a href="chat">' in pages.get("/dashboard").text


def test_chat_page_tells_the_browser_to_connect_only_to_its_server(pages):
    csp = dict(
        part.strip().split(" ", 1)
        for part in pages.get("/chat").headers["content-security-policy"].split(";")
    )
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    assert csp["script-src"] == csp["style-src"] == "'unsafe-inline'"
