"""`hmc`: the command-line front end to hmcd, the Memory API and the benchmarks.

Every command takes --json; errors print one line on stderr and exit non-zero.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from hmc.config import Config
from hmc.errors import HMCError

__all__ = ["main"]

EPILOG = """\
examples:
  hmc demo                      move 1 GiB over every path available here and verify it
  hmc status                    is hmcd up? what does this node have?
  hmc devices --json            memory domains (host, cuda:N, hip:N) and their vendors
  hmc buffers                   ConnBuffers registered on this node and its peers
  hmc path kv-prefill kv-decode which path a pair gets, and why better ones were refused
  hmc bench --quick             HMC's paths against socket, memcpy and NIXL baselines

configuration: --config FILE or $HMC_CONFIG (TOML), then HMC_* variables; see README.
"""


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--config", metavar="FILE", help="TOML config file (default: $HMC_CONFIG)")
    parser.add_argument("--address", metavar="ADDR", help="hmcd address: unix:/path or host:port (default: the config's socket)")
    parser.add_argument("--token", help="shared token for hmcd's TCP port (default: config / $HMC_TOKEN)")
    parser.add_argument("--timeout", type=float, metavar="S", help="deadline of each call in seconds")


def build_parser() -> argparse.ArgumentParser:
    from hmc.cli import _bench, _demo, _inspect

    parser = argparse.ArgumentParser(
        prog="hmc",
        description="HMC: move GPU and host memory between processes, GPUs and nodes of any vendor.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    registrars: list[Callable[[argparse._SubParsersAction], None]] = [  # type: ignore[type-arg]
        _inspect.register,
        _demo.register,
        _bench.register,
    ]
    for register in registrars:
        register(commands)
    for sub in commands.choices.values():
        _add_common(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = Config.load(args.config)
        if args.token is not None:
            config = config.replace(token=args.token)
        if args.timeout is not None:
            config = config.replace(timeout_s=args.timeout)
        return int(args.run(args, config) or 0)
    except HMCError as exc:
        print(f"hmc {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hmc {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
