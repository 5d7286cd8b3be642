"""The static files a web developer loads: the client library, its types, the pages."""

import httpx

from gateway.testing import run_gateway


def test_the_library_its_types_and_the_pages_are_served_with_their_types():
    with run_gateway() as gw:
        expected = {"/fanout.js": "text/javascript", "/fanout.d.ts": "application/typescript",
                    "/": "text/html", "/admin/": "text/html"}
        for path, content_type in expected.items():
            r = httpx.get(gw.http_url + path)
            assert r.status_code == 200, path
            assert r.headers["content-type"].startswith(content_type), (path, r.headers["content-type"])
        assert "export function connect" in httpx.get(gw.http_url + "/fanout.js").text
