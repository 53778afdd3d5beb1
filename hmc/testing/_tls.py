"""Certificates for TLS tests: a throwaway CA and a server certificate for 127.0.0.1 it signed, made with openssl."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["make_certificates"]


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """(CA, server certificate, server key) in `directory`, valid two days; the key is 0600."""
    ca_key, ca, key, csr, cert = (directory / name for name in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=hmc-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    key.chmod(0o600)
    return ca, cert, key
