"""Run Markdown code blocks in order in one namespace, as a reader pastes them. Used by test_docs.py.

A process of its own: the blocks build their own backends (never closed, as in the docs), write
`./.journeyman` under the working directory and register models in the process-wide endpoint
registry that `judge="local"` reads; none of that may leak into the pytest process.

    python tests/run_doc_blocks.py BLOCKS_JSON RESULTS_JSON

BLOCKS_JSON: a list of {"id", "path", "line", "source"}. Each block is compiled with top-level
`await` allowed and padded to its line in the Markdown file, so a traceback names the file and line.
RESULTS_JSON is rewritten after every block ({id: {"ok", "seconds", "error"}}): a run that times
out still says which blocks passed. The first failure stops the run (later blocks may need its names).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


async def run(blocks: list[dict[str, Any]], results_path: Path) -> None:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    results: dict[str, dict[str, Any]] = {}
    for block in blocks:
        t0 = time.perf_counter()
        try:
            code = compile(
                "\n" * block["line"] + block["source"],
                block["path"],
                "exec",
                flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
            )
            result = eval(code, namespace)
            if inspect.iscoroutine(result):
                await result
            results[block["id"]] = {"ok": True, "seconds": time.perf_counter() - t0}
        except BaseException:
            results[block["id"]] = {
                "ok": False,
                "seconds": time.perf_counter() - t0,
                "error": traceback.format_exc(),
            }
        results_path.write_text(json.dumps(results, indent=1))
        print(f"{block['id']}: {'ok' if results[block['id']]['ok'] else 'FAILED'}", flush=True)
        if not results[block["id"]]["ok"]:
            break


if __name__ == "__main__":
    blocks_path, results_path = (Path(a) for a in sys.argv[1:3])
    asyncio.run(run(json.loads(blocks_path.read_text()), results_path))
    sys.stdout.flush()
    # The blocks' backends are still serving (the docs never close them): skip their shutdown.
    os._exit(0)
