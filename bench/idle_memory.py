"""Where the RSS of an idle ``penstock serve --engine sample`` comes from.

Each figure is taken in a fresh interpreter:

- the server's steps in order (imports, the started sample engine and gateway, the app,
  its lifespan, uvicorn's configuration), RSS after each; the modules present at the end
  are the server's modules;
- the floor: those modules that are not Penstock's own, imported into a bare interpreter
  in the same order; then with Penstock's own modules too;
- what each of ``--without`` would save: the floor again with that package refused (the
  modules that need it fail to import and are left out).

    .venv/bin/python bench/idle_memory.py
    .venv/bin/python bench/idle_memory.py --without fastapi,pydantic_settings
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_WITHOUT = (
    "fastapi,pydantic_settings,opentelemetry,pydantic.v1,jinja2,tokenizers,click,"
    "multiprocessing,websockets,watchfiles,msgspec,prometheus_client"
)


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _server_steps(steps: list[tuple[str, float]]) -> None:
    import uvicorn

    from penstock.app.factory import create_app
    from penstock.app.server import build_gateway
    from penstock.settings import Settings

    steps.append(("imports", rss_mb()))
    settings = Settings(engine="sample", engine_args=["--delay", "0", "--max-tokens", "16"])
    gateway = await build_gateway(settings)
    steps.append(("engine started, gateway built", rss_mb()))
    app = create_app(gateway)
    steps.append(("app created", rss_mb()))
    try:
        async with app.router.lifespan_context(app):
            steps.append(("lifespan started", rss_mb()))
            uvicorn.Config(app, loop="uvloop", http="httptools", ws="none", lifespan="on").load()
            steps.append(("uvicorn configured", rss_mb()))
    finally:
        await gateway.host.cleanup()


def _child_server(out: Path) -> None:
    import logging

    import uvloop

    logging.basicConfig(level=logging.WARNING)
    steps: list[tuple[str, float]] = [("interpreter, uvloop, logging", rss_mb())]
    uvloop.run(_server_steps(steps))
    modules = [name for name in sys.modules if name != "__main__"]
    out.write_text(json.dumps({"steps": steps, "modules": modules}))
    print(f"{len(modules)} modules")


class _Refuse:
    """A meta path finder that makes the named packages (and their submodules) unimportable."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if any(name == refused or name.startswith(refused + ".") for refused in self.names):
            raise ImportError(f"refused: {name}")


def _child_import(modules_file: Path, own: bool, refused: list[str]) -> None:
    sys.meta_path.insert(0, _Refuse(refused))
    for name in json.loads(modules_file.read_text())["modules"]:
        if not own and name.split(".")[0] in ("penstock", "bench"):
            continue
        try:
            importlib.import_module(name)
        except Exception:
            continue  # it needs a refused package: left out
    print(json.dumps({"rss": rss_mb(), "modules": len(sys.modules)}))


def _python(*args: str) -> str:
    argv = [sys.executable, str(HERE / "idle_memory.py"), *args]
    done = subprocess.run(argv, cwd=HERE.parent, capture_output=True, text=True, check=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--without", default=DEFAULT_WITHOUT, help="packages to refuse, one by one")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, modules_file, *rest = args.child
        if kind == "server":
            _child_server(Path(modules_file))
        else:
            _child_import(Path(modules_file), own=kind == "own", refused=rest)
        return

    with tempfile.TemporaryDirectory() as folder:
        modules_file = Path(folder) / "server.json"
        _python("--child", "server", str(modules_file))
        server = json.loads(modules_file.read_text())
        print("The server's steps, RSS MB:")
        for step, value in server["steps"]:
            print(f"  {step:32s} {value:6.1f}")
        print(f"  ({len(server['modules'])} modules)")

        floor = json.loads(_python("--child", "floor", str(modules_file)))
        with_own = json.loads(_python("--child", "own", str(modules_file)))
        print("\nImported into a bare interpreter, RSS MB:")
        print(f"  {'third-party modules only':32s} {floor['rss']:6.1f}  ({floor['modules']})")
        print(f"  {'and Penstock own':32s} {with_own['rss']:6.1f}  ({with_own['modules']})")

        print("\nThe third-party floor without one package (what dropping it would save):")
        for refused in filter(None, args.without.split(",")):
            result = json.loads(_python("--child", "floor", str(modules_file), refused))
            saved = floor["rss"] - result["rss"]
            left_out = floor["modules"] - result["modules"]
            print(f"  {refused:24s} {saved:5.1f} MB  ({left_out} modules fewer)")


if __name__ == "__main__":
    main()
