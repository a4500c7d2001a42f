"""TLS for Waltz connections: PEM files in, :class:`ssl.SSLContext` out.

The original Waltz always used TLS, falling back to a self-signed certificate and to trusting any peer. Here
TLS is **opt-in** and never insecure: a component either speaks plain TCP (no TLS key set) or verifies its
peer. Certificates are PEM files (Java keystores do not apply). Every component reads the same keys under its
own prefix:

==================  ==========================================================================================
key                 meaning
==================  ==========================================================================================
``certFile``        PEM certificate (chain) this side presents; needs ``keyFile``
``keyFile``         PEM private key of ``certFile``, unencrypted (keep it readable by the process only)
``caFile``          PEM CA certificate(s) the *peer's* certificate must chain to
``checkHostname``   connecting side: the peer's certificate must name the host connected to (default true)
==================  ==========================================================================================

Prefixes and roles (REFERENCE §7.4):

* ``storage.ssl.`` (storage node, **listens** on its data and admin ports)
* ``server.ssl.`` (Waltz server: **listens** for clients *and* **connects** to storage nodes with the same
  keys, as the original did; its certificate therefore serves as client certificate too)
* ``client.ssl.`` (client library: network driver and LogReader, **connects**)
* ``ssl.`` in CLI config files (``-c``; admin commands **connect** to storage admin ports and servers)

Semantics:

* TLS is on for a component as soon as any of ``certFile``/``keyFile``/``caFile`` is set.
* A **listening** side needs ``certFile`` + ``keyFile``. With ``caFile`` it *requires* a client certificate
  signed by that CA (mutual TLS), like the original's truststore.
* A **connecting** side verifies the peer's certificate against ``caFile`` (or, without it, the system's
  default CAs) and, with ``checkHostname`` (the default), that it names the host connected to: connecting to
  ``127.0.0.1`` needs ``IP:127.0.0.1`` in the certificate's subjectAltName. With ``certFile`` + ``keyFile`` it
  presents a client certificate.
* TLS 1.2 is the minimum version on both sides.

Problems are reported as :class:`~waltz.errors.ConfigError` naming the key and the file: a missing or
unreadable file, a file that is not PEM, an encrypted key, or a key that does not match its certificate.
Contexts are built once per component at start-up; a process must be restarted to pick up new certificates.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from waltz.config import Key, read_bounded
from waltz.errors import ConfigError

__all__ = [
    "MIN_TLS_VERSION",
    "TLS_KEY_NAMES",
    "TlsConfig",
    "parse_peer_names",
    "peer_common_name",
    "tls_keys",
]

MIN_TLS_VERSION: Final = ssl.TLSVersion.TLSv1_2
TLS_KEY_NAMES: Final = ("certFile", "keyFile", "caFile", "checkHostname")
"""The key names under a component's ``*.ssl.`` prefix."""

Role = Literal["listen", "connect", "both"]

_MAX_PEM_BYTES: Final = 1024 * 1024
"""A PEM file larger than this is certainly not a certificate, key or CA bundle we should load."""


def tls_keys(prefix: str) -> list[Key]:
    """The schema keys of one component, e.g. ``tls_keys("storage.ssl.")``, for its :class:`ConfigSchema`."""
    return [
        Key(f"{prefix}certFile", str, "", "PEM certificate (chain) this side presents"),
        Key(f"{prefix}keyFile", str, "", "PEM private key of certFile (unencrypted)"),
        Key(f"{prefix}caFile", str, "", "PEM CA certificates the peer's certificate must chain to"),
        Key(
            f"{prefix}checkHostname", bool, True, "connecting side: the peer's certificate must name its host"
        ),
    ]


@dataclass(frozen=True)
class TlsConfig:
    """One component's TLS settings (paths, not contexts: build those with the ``*_context`` methods).

    ``prefix`` only names the keys in error messages. The default instance means "plain TCP".
    """

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    check_hostname: bool = True
    prefix: str = "ssl."

    @property
    def enabled(self) -> bool:
        """True when any file is set: the component speaks TLS."""
        return bool(self.cert_file or self.key_file or self.ca_file)

    @property
    def has_identity(self) -> bool:
        """True when this side has a certificate and key to present."""
        return bool(self.cert_file and self.key_file)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], prefix: str, *, role: Role, source: str = "config"
    ) -> TlsConfig:
        """Read ``<prefix>certFile`` etc. from a parsed config (dotted keys; absent keys mean unset).

        Checks the combination for ``role`` and that every file can be loaded (see :meth:`check`), so a bad
        setting fails when the configuration is read, not at the first connection.
        """
        raw_check = config.get(f"{prefix}checkHostname", True)
        if not isinstance(raw_check, bool):
            raise ConfigError(f"{source}: {prefix}checkHostname: expected true or false, got {raw_check!r}")
        tls = cls(
            cert_file=_path_value(config, f"{prefix}certFile", source),
            key_file=_path_value(config, f"{prefix}keyFile", source),
            ca_file=_path_value(config, f"{prefix}caFile", source),
            check_hostname=raw_check,
            prefix=prefix,
        )
        tls.check(role, source)
        return tls

    def check(self, role: Role, source: str = "config") -> None:
        """Raise ConfigError unless the contexts ``role`` needs can be built (no-op when TLS is off)."""
        if not self.enabled:
            return
        if role in ("listen", "both"):
            self.server_context(source)
        if role in ("connect", "both"):
            self.client_context(source)

    def server_context(self, source: str = "config") -> ssl.SSLContext | None:
        """The listening side's context, or None when TLS is off.

        Requires a client certificate signed by ``caFile`` when ``caFile`` is set.
        """
        if not self.enabled:
            return None
        if not self.has_identity:
            raise ConfigError(
                f"{source}: {self._missing_identity()}: a TLS listener needs a certificate and key"
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = MIN_TLS_VERSION
        self._load_identity(ctx, source)
        if self.ca_file:
            self._load_ca(ctx, source)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self, source: str = "config") -> ssl.SSLContext | None:
        """The connecting side's context, or None when TLS is off.

        Verifies the peer against ``caFile`` (else the system's CAs) and, with ``check_hostname``, its name.
        """
        if not self.enabled:
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(
                f"{source}: {self._missing_identity()}: a client certificate needs both "
                f"{self.prefix}certFile and {self.prefix}keyFile"
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = MIN_TLS_VERSION
        # PROTOCOL_TLS_CLIENT verifies by default; checkHostname=false keeps the chain check, drops the name.
        ctx.check_hostname = self.check_hostname
        ctx.verify_mode = ssl.CERT_REQUIRED
        if self.ca_file:
            self._load_ca(ctx, source)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
        if self.has_identity:
            self._load_identity(ctx, source)
        return ctx

    # -- loading, with errors that name the key and the file --

    def _missing_identity(self) -> str:
        if self.cert_file and not self.key_file:
            return f"{self.prefix}certFile is set but {self.prefix}keyFile is not"
        if self.key_file and not self.cert_file:
            return f"{self.prefix}keyFile is set but {self.prefix}certFile is not"
        return f"{self.prefix}caFile is set but {self.prefix}certFile and {self.prefix}keyFile are not"

    def _load_identity(self, ctx: ssl.SSLContext, source: str) -> None:
        cert_key, key_key = f"{self.prefix}certFile", f"{self.prefix}keyFile"
        cert_text = _read_pem(self.cert_file, cert_key, source)
        if "-----BEGIN CERTIFICATE-----" not in cert_text:
            raise ConfigError(f"{source}: {cert_key}: {self.cert_file} holds no PEM certificate")
        key_text = _read_pem(self.key_file, key_key, source)
        if "ENCRYPTED" in key_text:
            raise ConfigError(
                f"{source}: {key_key}: {self.key_file} is encrypted; give an unencrypted key "
                "(protect it with file permissions)"
            )
        if "PRIVATE KEY-----" not in key_text:
            raise ConfigError(f"{source}: {key_key}: {self.key_file} holds no PEM private key")
        try:
            # A password callback that fails stops OpenSSL from ever prompting on the terminal.
            ctx.load_cert_chain(self.cert_file, self.key_file, password=_no_password)
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise ConfigError(
                    f"{source}: {key_key}: {self.key_file} is not the private key of the certificate in "
                    f"{cert_key} ({self.cert_file})"
                ) from None
            raise ConfigError(
                f"{source}: cannot load {cert_key} {self.cert_file} with {key_key} {self.key_file}: "
                f"{_ssl_reason(e)}"
            ) from None
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{source}: cannot load {cert_key} {self.cert_file} with {key_key} {self.key_file}: {e}"
            ) from None

    def _load_ca(self, ctx: ssl.SSLContext, source: str) -> None:
        ca_key = f"{self.prefix}caFile"
        text = _read_pem(self.ca_file, ca_key, source)
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise ConfigError(f"{source}: {ca_key}: {self.ca_file} holds no PEM certificate")
        try:
            ctx.load_verify_locations(cafile=self.ca_file)
        except ssl.SSLError as e:
            raise ConfigError(f"{source}: {ca_key}: cannot load {self.ca_file}: {_ssl_reason(e)}") from None
        except OSError as e:
            raise ConfigError(f"{source}: {ca_key}: cannot load {self.ca_file}: {e}") from None


def _no_password() -> str:
    raise ValueError("encrypted private keys are not supported")


def _path_value(config: Mapping[str, Any], key: str, source: str) -> str:
    value = config.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {key}: expected a file path, got {value!r}")
    return value.strip()


def _read_pem(path: str, key: str, source: str) -> str:
    # Bounded by the bytes actually read, not by stat(): /dev/zero claims 0 bytes and never ends.
    try:
        return read_bounded(path, _MAX_PEM_BYTES).decode("ascii", errors="replace")
    except ValueError:
        raise ConfigError(
            f"{source}: {key}: {path} holds more than {_MAX_PEM_BYTES} bytes; not a PEM file"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: {key}: {path} is a directory, not a PEM file") from None
    except OSError as e:
        raise ConfigError(f"{source}: {key}: cannot read {path}: {e.strerror or e}") from None


def _ssl_reason(e: ssl.SSLError) -> str:
    return f"{e.library or 'SSL'} error {e.reason or e}"


def peer_common_name(peercert: Mapping[str, Any] | None) -> str | None:
    """The subject commonName of a verified peer certificate (``getpeercert()`` form), None if it has none."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return str(value)
    return None


def parse_peer_names(raw: str) -> tuple[str, ...]:
    """A comma-separated allow-list of certificate common names (blank entries dropped)."""
    return tuple(n.strip() for n in raw.split(",") if n.strip())
