"""What a server that only streams text leaves unimported (each costs idle memory), and
what ``penstock serve --help`` leaves unimported (it answers at once)."""

from __future__ import annotations

from tests.support.snippet import run_snippet

# Imported where a media fetch, a metadata upload, a job store, a media store or an image
# first needs them; numpy where a weight delta or an answer of packed arrays (binary
# teacher logprobs, routed experts) does.
ON_FIRST_USE = ["httpx", "httpcore", "zstandard", "sqlalchemy", "fsspec", "PIL", "numpy"]


def test_a_text_server_imports_none_of_what_only_media_or_uploads_need() -> None:
    code = f"""
        import asyncio, json, sys
        from penstock.app.cli import main as _cli
        from penstock.app.factory import create_app
        from penstock.app.middleware import WireSend
        from penstock.app.server import build_gateway
        from penstock.settings import Settings

        async def chat(app) -> int:
            body = json.dumps(
                {{"model": "sample-model", "stream": True, "max_tokens": 4,
                  "messages": [{{"role": "user", "content": "hi"}}]}}
            ).encode()
            scope = {{
                "type": "http", "asgi": {{"version": "3.0"}}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {{}},
            }}
            messages = [{{"type": "http.request", "body": body, "more_body": False}}]
            statuses = []

            async def receive():
                if messages:
                    return messages.pop()
                await asyncio.Event().wait()

            async def send(message):
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            await WireSend(app)(scope, receive, send)
            return statuses[0]

        async def main() -> None:
            gateway = await build_gateway(Settings(engine="sample"))
            app = create_app(gateway)
            try:
                async with app.router.lifespan_context(app):
                    assert await chat(app) == 200
            finally:
                await gateway.host.cleanup()

        asyncio.run(main())
        print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({ON_FIRST_USE!r}))))
        """
    result = run_snippet(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_serve_help_imports_no_engine_and_no_torch() -> None:
    code = """
        import json, sys
        from penstock.app.cli import main

        try:
            main(["serve", "--help"])
        except SystemExit as exited:
            assert exited.code == 0
        heavy = {"torch", "transformers", "penstock.engines.transformers.engine"}
        print(json.dumps(sorted(heavy & set(sys.modules))))
        """
    result = run_snippet(code)
    assert result.returncode == 0, result.stderr
    assert "--max-model-len" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"
