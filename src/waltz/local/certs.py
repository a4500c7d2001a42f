"""Throwaway certificates for a local cluster and for tests, made with the ``openssl`` command-line tool.

:func:`make_local_pki` writes, under one directory::

    ca.pem           a new self-signed CA (EC P-256), valid ``days`` days; its key is deleted at once
    <name>.pem       one certificate per name, signed by the CA, for IP:127.0.0.1 and DNS:localhost, usable
                     as server *and* client certificate (extendedKeyUsage serverAuth, clientAuth), so one
                     file serves a process's listening and connecting sides
    <name>-key.pem   its private key

Private keys are written unencrypted with mode 0600. Nothing here is meant for production: the point is a
cluster on loopback that exercises the same TLS code paths (mutual TLS, hostname checks) a real one does.
Python has no X.509 writer in its standard library, and Waltz adds no dependency for this, hence ``openssl``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from waltz.errors import ConfigError

__all__ = ["LocalPki", "find_openssl", "make_local_pki"]

DEFAULT_DAYS: Final = 30
OPENSSL_TIMEOUT_S: Final = 30.0
LOCAL_SUBJECT_ALT_NAMES: Final = ("IP:127.0.0.1", "DNS:localhost")

_CONFIG: Final = """\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = unused

[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[leaf_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = {alt_names}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


@dataclass(frozen=True)
class LocalPki:
    """Where :func:`make_local_pki` put the files."""

    directory: Path
    ca_file: Path

    def cert_file(self, name: str) -> Path:
        return self.directory / f"{name}.pem"

    def key_file(self, name: str) -> Path:
        return self.directory / f"{name}-key.pem"


def find_openssl() -> str:
    """The path of the ``openssl`` tool; ConfigError (with what to install) if there is none."""
    path = shutil.which("openssl")
    if path is None:
        raise ConfigError(
            "TLS certificates are generated with the openssl command-line tool, which is not on PATH; "
            "install it (Debian/Ubuntu: apt-get install openssl) or run without --tls"
        )
    return path


def make_local_pki(
    directory: str | Path,
    names: Iterable[str],
    *,
    days: int = DEFAULT_DAYS,
    alt_names: Sequence[str] = LOCAL_SUBJECT_ALT_NAMES,
) -> LocalPki:
    """Create a CA and one certificate per name in ``directory`` (created if needed; files are overwritten).

    Raises ConfigError when ``openssl`` is missing or fails (its error output is included).
    """
    openssl = find_openssl()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = d / "openssl.cnf"
    config.write_text(_CONFIG.format(alt_names=", ".join(alt_names)), encoding="ascii")
    ca_key = d / "ca-key.pem"
    pki = LocalPki(d, d / "ca.pem")
    try:
        _run(
            openssl,
            *("req", "-x509", "-new", "-config", str(config), "-extensions", "ca_ext"),
            *_new_key_args(ca_key),
            *("-subj", "/CN=Waltz local CA", "-days", str(days), "-out", str(pki.ca_file)),
        )
        for name in names:
            csr = d / f"{name}.csr"
            key = pki.key_file(name)
            _run(
                openssl,
                *("req", "-new", "-config", str(config)),
                *_new_key_args(key),
                *("-subj", f"/CN=waltz {name}", "-out", str(csr)),
            )
            serial = str(int.from_bytes(os.urandom(8), "big") >> 1)
            _run(
                openssl,
                *("x509", "-req", "-in", str(csr), "-CA", str(pki.ca_file), "-CAkey", str(ca_key)),
                *("-set_serial", serial, "-days", str(days), "-extfile", str(config)),
                *("-extensions", "leaf_ext", "-out", str(pki.cert_file(name))),
            )
            csr.unlink()
            key.chmod(0o600)
    finally:
        # The CA only signs what is made here: without its key no one can add a certificate later.
        ca_key.unlink(missing_ok=True)
        config.unlink(missing_ok=True)
    return pki


def _new_key_args(key: Path) -> list[str]:
    # EC P-256: a key in milliseconds (RSA would take up to a second each), accepted by every TLS 1.2+ stack.
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key)]


def _run(openssl: str, *args: str) -> None:
    try:
        done = subprocess.run(
            [openssl, *args],
            capture_output=True,
            text=True,
            timeout=OPENSSL_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"running openssl {args[0]} failed: {e}") from None
    if done.returncode != 0:
        tail = " ".join(done.stderr.split())[-500:]
        raise ConfigError(f"openssl {args[0]} failed (exit {done.returncode}): {tail}")
