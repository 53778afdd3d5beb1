"""`hmcd`: run the per-node daemon in the foreground.

Concurrency: the main thread runs the asyncio loop (uvloop when importable) that
owns the whole daemon; SIGTERM and SIGINT are handled on that loop and stop it
gracefully (watches end, agents' streams close, the socket file is removed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence

from hmc.config import Config
from hmc.control._hmcd import Daemon
from hmc.errors import HMCError

__all__ = ["main", "parse_args"]

log = logging.getLogger("hmc.hmcd")

_NOFILE_UNLIMITED = 1 << 20
"""The soft limit asked for when the hard one is unlimited (Linux's default fs.nr_open)."""

_EPILOG = """\
Settings come from, in rising precedence: defaults, the TOML file (--config or
$HMC_CONFIG), HMC_* environment variables, then these options.

examples:
  hmcd                                   local agents only, on the default socket
  hmcd --listen 0.0.0.0:7710 --token s3cret --static-peer 10.0.0.2:7710
  hmcd --listen 0.0.0.0:7710 --tls-cert node.pem --tls-key node.key --tls-ca ca.pem --static-peer 10.0.0.2:7710
  hmcd --socket /tmp/a.sock --listen 127.0.0.1:0 --port-file /tmp/a.port
  hmcd --listen 10.0.0.1:7710 --token s3cret --etcd http://10.0.0.9:2379 --etcd http://10.0.0.10:2379

The unix socket's directory is created 0700; hmcd refuses an existing one that is
not its own or that grants anything to group or others, and admits on the socket
only its own uid and root (checked by peer credentials).
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hmcd",
        description="HMC's per-node daemon: device inventory, the ConnBuffer registry of local agents, "
        "path negotiation, third-party transfers, events and metrics, over gRPC on a unix socket and optionally TCP.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file (default: $HMC_CONFIG)")
    parser.add_argument("--socket", metavar="PATH", help="unix socket for local agents and clients (default: $XDG_RUNTIME_DIR/hmc/hmcd.sock)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="also serve on TCP (port 0 picks a free port; see --port-file)")
    parser.add_argument("--port-file", metavar="FILE", help="write the bound TCP port here once serving (for scripts and tests)")
    parser.add_argument("--token", help="shared secret every TCP call must carry (prefer HMC_TOKEN or the config file: argv is visible to other users)")
    parser.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TCP over TLS (with --tls-key)")
    parser.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (unencrypted; keep it 0600)")
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle: speak TLS to static peers, trusting only this CA")
    parser.add_argument("--node", help="this node's name (default: the hostname)")
    parser.add_argument("--static-peer", action="append", default=None, metavar="HOST:PORT", help="another hmcd's TCP address; repeat for several")
    parser.add_argument("--etcd", action="append", default=None, metavar="ENDPOINT", help="use the etcd directory at this endpoint (http[s]://host:port); repeat for several")
    parser.add_argument("--etcd-prefix", metavar="PREFIX", help="this cluster's key prefix in etcd (default: /hmc)")
    parser.add_argument("--etcd-lease-ttl", type=int, metavar="SECONDS", help="TTL of this hmcd's etcd lease (default: 5)")
    parser.add_argument("--etcd-ca", metavar="FILE", help="PEM CA bundle to verify etcd (TLS to etcd)")
    parser.add_argument("--etcd-cert", metavar="FILE", help="PEM client certificate for etcd (with --etcd-key)")
    parser.add_argument("--etcd-key", metavar="FILE", help="PEM private key of --etcd-cert")
    parser.add_argument("--metrics-port", type=int, metavar="PORT", help="also serve Prometheus /metrics over HTTP on this port (0 picks one)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity (default: info)")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    """The Config from file and environment, with command-line options on top."""
    config = Config.load(args.config)
    changes = {
        name: value
        for name, value in (
            ("socket", args.socket),
            ("listen", args.listen),
            ("token", args.token),
            ("node", args.node),
            ("tls_cert", args.tls_cert),
            ("tls_key", args.tls_key),
            ("tls_ca", args.tls_ca),
            ("etcd_prefix", args.etcd_prefix),
            ("etcd_lease_ttl_s", args.etcd_lease_ttl),
            ("etcd_ca", args.etcd_ca),
            ("etcd_cert", args.etcd_cert),
            ("etcd_key", args.etcd_key),
        )
        if value is not None
    }
    if args.static_peer is not None:
        changes["static_peers"] = tuple(args.static_peer)
    if args.etcd is not None:
        changes["directory"], changes["etcd_endpoints"] = "etcd", tuple(args.etcd)
    return config.replace(**changes)


async def serve(config: Config, port_file: str | None = None, metrics_port: int | None = None) -> None:
    """Run a daemon until SIGTERM/SIGINT."""
    daemon = Daemon(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await daemon.start(metrics_port)
    try:
        if daemon.tcp_address:
            log.info("tcp port %s", daemon.tcp_address.rsplit(":", 1)[1])
            if port_file:
                _write_atomically(port_file, daemon.tcp_address.rsplit(":", 1)[1] + "\n")
        elif port_file:
            log.warning("--port-file given but hmcd does not listen on TCP (no --listen); not writing it")
        await stop.wait()
        log.info("stopping on signal")
    finally:
        await daemon.stop()


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one: at systemd's usual 1024, a client holding that many
    silent TCP connections would leave hmcd no descriptor for its own node's agents on the unix socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _NOFILE_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the limit on open files from %d to %d: %s", soft, target, exc)
            return
        log.info("raised the soft limit on open files from %d to %d (the hard limit)", soft, target)


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as fh:
        fh.write(text)
    os.replace(temporary, path)


def _run(coroutine: object) -> None:
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        asyncio.run(coroutine)  # type: ignore[arg-type]
    else:
        uvloop.run(coroutine)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s hmcd[%(process)d] %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("hmc").setLevel(args.log_level.upper())  # gRPC's own debug chatter stays out
    raise_open_files_limit()
    try:
        config = build_config(args)
        _run(serve(config, args.port_file, args.metrics_port))
    except HMCError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
