"""The GCE metadata server, asked only on a GCE VM, never for longer than a second.

A Cloud TPU VM created with ``gcloud compute tpus tpu-vm create`` (or a queued
resource) describes its slice in its instance metadata, not in environment variables:
``agent-worker-number`` (this host's worker id), ``worker-network-endpoints`` (the
slice's hosts), ``accelerator-type`` and ``tpu-env`` (lines ``KEY: 'value'``: the
topology, the zone, the TPU's name as ``NODE_ID``, and for a multislice queued resource
the ``MEGASCALE_*`` values). JAX's own TPU detection reads the same keys.

Whether this machine is a GCE VM is read from the DMI product name first
(``/sys/class/dmi/id/product_name`` says "Google Compute Engine" on every GCE VM, GKE
nodes included), without the network: elsewhere the metadata server is never asked, so
a laptop or a GPU cluster never waits on a connection that cannot succeed. Each request
has a timeout of one second, goes to the link-local address 169.254.169.254 (no DNS
lookup to wait for; ``GCE_METADATA_HOST`` or ``GCE_METADATA_IP`` override it, the
variables Google's client libraries and JAX read) and bypasses any HTTP proxy.

Example:
    >>> Metadata({}).available   # off GCE: the server is never asked
    False
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Mapping

DMI_PRODUCT_NAME = "/sys/class/dmi/id/product_name"
DEFAULT_HOST = "169.254.169.254"
ENV_METADATA_HOST = "GCE_METADATA_HOST"
ENV_METADATA_IP = "GCE_METADATA_IP"
# libtpu's and JAX's own switch; GKE sets it in TPU pods, JAX on machines without TPU chips.
ENV_SKIP_QUERY = "TPU_SKIP_MDS_QUERY"
TIMEOUT_SECONDS = 1.0
_ATTRIBUTES = "/computeMetadata/v1/instance/attributes/"


def dmi_product_name(path: str | None = None) -> str | None:
    """The machine's DMI product name ("Google Compute Engine" on GCE), or None if unreadable."""
    try:
        with open(path or DMI_PRODUCT_NAME, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def on_gce(path: str | None = None) -> bool:
    """Whether this machine is a GCE VM, from its DMI product name (no network).

    Example:
        >>> on_gce("/nonexistent")
        False
    """
    name = dmi_product_name(path)
    return name is not None and name.startswith("Google")


def parse_tpu_env(text: str) -> dict[str, str]:
    """The ``tpu-env`` attribute's ``KEY: 'value'`` lines as a dict.

    Example:
        >>> parse_tpu_env("ACCELERATOR_TYPE: 'v4-16'\\nHOST_BOUNDS: '1,1,2'")
        {'ACCELERATOR_TYPE': 'v4-16', 'HOST_BOUNDS': '1,1,2'}
    """
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip().strip("'\"")
    return out


class Metadata:
    """This VM's instance attributes, fetched on first use; never fetched off GCE.

    Args:
        environ: the environment (``TPU_SKIP_MDS_QUERY``, ``GCE_METADATA_HOST``).
        dmi_path: the DMI product-name file (tests point it elsewhere).

    Raises (on use):
        TimeoutError: the server did not answer within a second.
        RuntimeError: the server answered with an error, or is not GCE's.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, dmi_path: str | None = None):
        env = os.environ if environ is None else environ
        self.product_name = dmi_product_name(dmi_path)
        self.skip = env.get(ENV_SKIP_QUERY)
        self.on_gce = self.product_name is not None and self.product_name.startswith("Google")
        self.host = env.get(ENV_METADATA_HOST) or env.get(ENV_METADATA_IP) or DEFAULT_HOST
        self._cache: dict[str, str | None] = {}
        self._tpu_env: dict[str, str] | None = None

    @property
    def available(self) -> bool:
        """Whether the server may be asked: a GCE VM, and TPU_SKIP_MDS_QUERY unset."""
        return self.on_gce and not self.skip

    def why_not(self) -> str:
        """Why the server is not asked, for error messages."""
        if not self.on_gce:
            shown = "unreadable" if self.product_name is None else repr(self.product_name)
            return (
                f"this machine is not a GCE VM (DMI product name {shown} at {DMI_PRODUCT_NAME}), "
                "so its GCE metadata was not read"
            )
        return (
            f"{ENV_SKIP_QUERY}={self.skip!r} (set by GKE in TPU pods, and by JAX on a machine "
            "without TPU chips) says not to read the GCE metadata"
        )

    def url(self, key: str) -> str:
        return f"http://{self.host}{_ATTRIBUTES}{key}"

    def attribute(self, key: str) -> str | None:
        """The instance attribute ``key`` (None: not set on this VM, or not on GCE)."""
        if not self.available:
            return None
        if key not in self._cache:
            self._cache[key] = self._get(key)
        return self._cache[key]

    def tpu_env(self, key: str) -> str | None:
        """``key`` in the ``tpu-env`` attribute (None if absent)."""
        if self._tpu_env is None:
            text = self.attribute("tpu-env")
            self._tpu_env = parse_tpu_env(text) if text else {}
        value = self._tpu_env.get(key)
        return value or None

    def _get(self, key: str) -> str | None:
        url = self.url(key)
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        # The metadata server is link-local: a proxy from http_proxy must not see it.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=TIMEOUT_SECONDS) as response:
                if response.headers.get("Metadata-Flavor") != "Google":
                    raise RuntimeError(
                        f"{url} answered without the 'Metadata-Flavor: Google' header: expected "
                        f"GCE's metadata server at {self.host}. Check {ENV_METADATA_HOST}."
                    )
                return str(response.read().decode("utf-8", errors="replace")).strip()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise RuntimeError(
                f"The GCE metadata server answered {e.code} {e.reason} for {url}; expected 200 "
                "or 404 (attribute not set)."
            ) from None
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise TimeoutError(
                f"The GCE metadata server did not answer {url} within {TIMEOUT_SECONDS:g} s "
                f"({reason}). Expected it on a GCE VM (DMI product name "
                f"{self.product_name!r}); check {ENV_METADATA_HOST}, or set {ENV_SKIP_QUERY}=1 "
                "and give the TPU_* variables instead."
            ) from None
