"""``python -m conformance`` (and the ``fsdp-conformance`` console script): which suite this is.

The suite itself runs under pytest; this command only says which versions are installed, which
is what a bug report or a question about an adapter needs first, and how to run the suite.
"""

from __future__ import annotations

import argparse

# How the suite runs: a pytest plugin over the installed package's scenarios.
USAGE = (
    "run the conformance suite with pytest:\n"
    "  python -m pytest --pyargs conformance --backend package.module:AdapterClass [--backend-path DIR]\n"
    "(--backend-path puts DIR at the front of sys.path, where your adapter's package lives; "
    "docs/writing-an-adapter.md says how to write one)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        description="The FSDP conformance suite: its versions, and how to run it.",
        epilog=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="print the package version, the adapter protocol version and the supported torch range",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Imported here: the protocol imports torch, which a bad argument or --help need not wait for.
    from conformance.protocol.versions import version_line

    if args.version:
        print(version_line())
    else:
        print(USAGE)
        print(version_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
