"""``python -m pipeline.producers.sglang_launch``: start an SGLang server for a run, on a port chosen on its node.

``engine.launch = true`` makes each engine of a run an SGLang server that sluice starts as a Ray actor's child
(``pipeline.launch.launcher.launch_engines``), like a CPU engine. SGLang takes its HTTP port as a number and cannot
report a port the OS chose, so this wrapper, already on the node Ray placed it on, binds port 0 on the engine's
address to learn a free port, writes it to ``--port-file`` (the actor reports it; the URL goes to
``RUN_DIR/engines.json``), closes the socket and replaces itself with the server (``os.execv``: the same PID, so the
supervisor's signals and the reaper reach SGLang itself). Between the close and SGLang's bind another process could
take the port; SGLang then fails to start and the supervisor restarts the engine, which picks again. A restart that
found its port once keeps it (``--port`` is then that number), so the URL producers and the trainer know stays valid.

``--python`` (``engine.python``) names the interpreter that runs the server, usually the python of SGLang's own
virtual environment: SGLang pins its own torch and CUDA kernels, which rarely match sluice's.

Everything after ``--`` is passed to the server as is: the launch command sluice builds (``--model-path``,
``--weight-version``, ``--enable-return-routed-experts``) followed by the recipe's ``engine.launch_args``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from pipeline.net import free_port


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, server_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m pipeline.producers.sglang_launch", description=__doc__)
    parser.add_argument("--module", default="sglang.launch_server", help="the server's Python module")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0, help="0: pick a free one on --host")
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that runs --module (a path or a command on PATH); default: this one")
    args = parser.parse_args(ours)
    python = shutil.which(args.python)
    if python is None:
        sys.exit(f"sglang_launch: engine.python = {args.python!r} is neither an executable file nor a command on "
                 "this node's PATH; name the python of the environment SGLang is installed in")
    port = args.port or free_port(args.host)
    partial = Path(args.port_file).with_suffix(".tmp")
    partial.write_text(str(port))
    partial.rename(args.port_file)
    cmd = [python, "-m", args.module, "--host", args.host, "--port", str(port), *server_args]
    print(f"sglang_launch: exec {' '.join(cmd)}", flush=True)
    os.execv(python, cmd)


if __name__ == "__main__":
    main()
