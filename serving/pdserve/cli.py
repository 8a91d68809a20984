"""`pdserve ROLE [options]`: run one pdserve component.

ROLE is prefill, decode or colocated (the model servers in pdserve.server), gateway or scheduler (the control
plane), or agent (the sidecar registering a vLLM instance with the scheduler); each of the last three is a module
exposing main(argv). `pdserve ROLE --help` lists a role's options and their PDSERVE_* variables.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence

SERVER_ROLES = ("prefill", "decode", "colocated")
CONTROL_ROLES = ("gateway", "scheduler", "agent")
USAGE = (
    f"usage: pdserve ROLE [options]   (ROLE: {' | '.join(SERVER_ROLES + CONTROL_ROLES)}; pdserve ROLE --help)\n"
    "       pdserve --version"
)


BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def limit_blas_threads(argv: Sequence[str]) -> None:
    """Set the BLAS thread count before numpy loads (it reads it once). Variables already set are left alone."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--blas-threads", default=os.environ.get("PDSERVE_BLAS_THREADS", "1"))
    threads = pre.parse_known_args(list(argv))[0].blas_threads
    for variable in BLAS_THREAD_VARIABLES:
        os.environ.setdefault(variable, str(threads))


def run_server(role: str, argv: Sequence[str]) -> None:
    limit_blas_threads(argv)
    from pdserve.common.logs import configure  # noqa: PLC0415  (imported after the BLAS thread limit is set)
    from pdserve.common.tls import TLSFileError, check_files  # noqa: PLC0415
    from pdserve.common.tracing import configure_tracing  # noqa: PLC0415
    from pdserve.listener import serve_component  # noqa: PLC0415
    from pdserve.server import create_app  # noqa: PLC0415
    from pdserve.server.settings import settings_from_args  # noqa: PLC0415

    settings = settings_from_args(role, argv)
    try:
        check_files(settings)
    except TLSFileError as error:
        raise SystemExit(f"pdserve {role}: invalid configuration: {error}") from None
    configure(role, settings.log_level)
    configure_tracing(role, settings, {"pdserve.engine_id": settings.engine_id, "pdserve.version": settings.version})
    serve_component(create_app(settings), settings, graceful_shutdown_seconds=5)


def run_control_plane(role: str, argv: Sequence[str]) -> None:
    try:
        module = importlib.import_module(f"pdserve.{role}")
    except ImportError as error:
        raise SystemExit(f"pdserve {role}: this installation has no pdserve.{role} module ({error})") from None
    entry = getattr(module, "main", None)
    if entry is None:
        raise SystemExit(f"pdserve {role}: pdserve.{role} has no main(argv) entry point")
    entry(list(argv))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        raise SystemExit(0 if args else 2)
    role, rest = args[0], args[1:]
    if role == "--version":
        print(f"pdserve {importlib.metadata.version('pdserve')}")
    elif role in SERVER_ROLES:
        run_server(role, rest)
    elif role in CONTROL_ROLES:
        run_control_plane(role, rest)
    else:
        raise SystemExit(f"pdserve: unknown role {role!r}\n{USAGE}")


if __name__ == "__main__":
    main()
