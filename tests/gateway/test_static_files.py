"""The static files a web developer loads: the client library, its types, the pages."""

from gateway.testing import run_gateway
from tests import web


def test_the_library_its_types_and_the_pages_are_served_with_their_types():
    with run_gateway() as gw:
        expected = {
            "/fanout.js": "text/javascript",
            "/fanout.d.ts": "application/typescript",
            "/": "text/html",
            "/admin/": "text/html",
        }
        for path, content_type in expected.items():
            r = web.get(gw.http_url + path)
            assert r.status_code == 200, path
            assert r.headers["content-type"].startswith(content_type), (path, r.headers["content-type"])
        assert "export function connect" in web.get(gw.http_url + "/fanout.js").text


def test_the_favicon_is_served():
    with run_gateway() as gw:
        r = web.get(gw.http_url + "/favicon.ico")
        assert r.status_code == 200 and r.content[:4] == b"\x00\x00\x01\x00"  # an ICO file


def test_the_library_names_allowed_origins_only_and_is_revalidated_by_its_etag():
    site = "https://app.example.com"
    with run_gateway(server={"allowed_origins": [site]}) as gw:
        for path in ("/fanout.js", "/fanout.d.ts"):
            allowed = web.get(gw.http_url + path, headers={"Origin": site})
            assert allowed.headers["access-control-allow-origin"] == site
            assert allowed.headers["cache-control"] == "no-cache" and "Origin" in allowed.headers["vary"]
            foreign = web.get(gw.http_url + path, headers={"Origin": "https://evil.example"})
            assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers
            etag = allowed.headers["etag"]
            again = web.get(gw.http_url + path, headers={"Origin": site, "If-None-Match": etag})
            assert again.status_code == 304 and again.headers["access-control-allow-origin"] == site
        page = web.get(gw.http_url + "/", headers={"Origin": site})
        assert "access-control-allow-origin" not in page.headers  # only the library is for other sites


def test_every_origin_may_load_the_library_when_every_origin_is_allowed():
    with run_gateway(server={"allowed_origins": ["*"]}) as gw:
        r = web.get(gw.http_url + "/fanout.js", headers={"Origin": "https://any.example"})
        assert r.headers["access-control-allow-origin"] == "*"
