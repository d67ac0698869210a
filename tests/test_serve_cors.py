"""serve --allowed-origins: a web page of an allowed origin may call the server (CORS), its
browser's preflight answered before the API key is asked for; without the flag, or from another
origin, the answers carry no such header and the browser keeps them from the page."""

from __future__ import annotations

import pytest

from pocketllm.commands.make_checkpoint import CHAT_TEMPLATE, write_byte_tokenizer
from pocketllm.serving.app import Served, build_app
from pocketllm.serving.chat_template import ChatTemplate
from pocketllm.serving.protocol import Limits

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def client(tmp_path, **served):
    from starlette.testclient import TestClient
    from tokenizers import Tokenizer

    write_byte_tokenizer(tmp_path / "tokenizer.json")
    # No engine: nothing here reaches one (a preflight, the model list, a refusal).
    app = build_app(Served(Limits("m", 64, 1000), Tokenizer.from_file(str(tmp_path / "tokenizer.json")), ChatTemplate(CHAT_TEMPLATE), (0,),
                           None, **served))
    return TestClient(app)


@pytest.mark.parametrize("allowed", [(PAGE,), ("*",)], ids=["the-page", "any"])
def test_an_allowed_origins_page_may_call_the_server_and_its_preflight_needs_no_key(tmp_path, allowed):
    c = client(tmp_path, api_key="k", allowed_origins=allowed)
    r = c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in (PAGE, "*")
    assert "POST" in r.headers["access-control-allow-methods"] and "authorization" in r.headers["access-control-allow-headers"].lower()
    r = c.get("/v1/models", headers={"Origin": PAGE, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in (PAGE, "*") and r.json()["data"][0]["id"] == "m"
    # The key is still asked for, and the page can read the refusal.
    r = c.get("/v1/models", headers={"Origin": PAGE})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] in (PAGE, "*")


def test_without_the_flag_or_from_another_origin_no_page_is_let_in(tmp_path):
    r = client(tmp_path).get("/v1/models", headers={"Origin": PAGE})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    c = client(tmp_path, allowed_origins=("https://app.example",))
    r = c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": PAGE}).headers
