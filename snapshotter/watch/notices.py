"""Reclaim notices of cloud providers, read from their instance metadata services.

The provider is known at start from the DMI files the machine exposes (as cloud-init reads them),
or named by the user; the metadata service is never asked anything otherwise: a box that is not
on that cloud must not send requests to 169.254.169.254."""

from __future__ import annotations

import os
from typing import Callable, Optional

import requests

from snapshotter import jsontext
from snapshotter.errors import UsageError

DMI_DIR = "/sys/class/dmi/id"
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"  # chassis_asset_tag of every Azure VM
PROVIDERS = ("aws", "gcp", "azure")
DEFAULT_BASE_URL = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
TIMEOUT = 2  # seconds per request: a poll must never hold up the next one
AWS_TOKEN_TTL = "21600"


def _dmi(dmi_dir: str, name: str) -> str:
    try:
        with open(os.path.join(dmi_dir, name), errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def detect_provider(dmi_dir: Optional[str] = None) -> Optional[str]:
    """aws, gcp or azure when the DMI files say so; None anywhere else (containers often have none)."""
    d = dmi_dir or os.environ.get("SNAP_DMI_DIR") or DMI_DIR
    vendor, product = _dmi(d, "sys_vendor"), _dmi(d, "product_name")
    board, asset = _dmi(d, "board_vendor"), _dmi(d, "chassis_asset_tag")
    if vendor == "Amazon EC2" or board == "Amazon EC2" or _dmi(d, "bios_vendor") == "Amazon EC2":
        return "aws"
    if vendor == "Google" or product == "Google Compute Engine" or board == "Google":
        return "gcp"
    if asset == AZURE_ASSET_TAG:
        return "azure"
    return None


class NoticeWatcher:
    """Asks one provider's metadata service whether the machine is being reclaimed. check() returns
    a one-line description of the notice, or None; errors count as "no notice" (the service may be
    slow to start, and a watcher must not stop because of it)."""

    def __init__(self, provider: str, base_url: Optional[str] = None):
        if provider not in PROVIDERS:
            raise UsageError(f"provider {provider!r} is not known", "use aws, gcp, azure, auto or none")
        self.provider = provider
        self.base_url = (base_url or os.environ.get("SNAP_METADATA_URL") or DEFAULT_BASE_URL[provider]).rstrip("/")
        self.session = requests.Session()
        self.session.trust_env = False  # metadata requests never go through an HTTP proxy from the environment
        self._aws_token: Optional[str] = None
        self.last_error: Optional[str] = None
        self.malformed_told = False

    def check(self, log: Callable[[str], None] = lambda msg: None) -> Optional[str]:
        """The notice, or None. An answer that is no notice's form is none too, said once in `log`
        (it would be at every poll); one that failed (not up yet, a timeout) is not said."""
        try:
            notice = getattr(self, f"_check_{self.provider}")()
            self.last_error = None
            return notice
        except (requests.RequestException, ValueError) as e:
            self.last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if not isinstance(e, requests.RequestException) and not self.malformed_told:
                self.malformed_told = True
                log(f"reclaim notices: the {self.provider} metadata service at {self.base_url} answered no notice's "
                    f"form ({self.last_error}); taken as no notice")
            return None

    def _get(self, path: str, headers: dict) -> requests.Response:
        return self.session.get(self.base_url + path, headers=headers, timeout=TIMEOUT, allow_redirects=False)

    def _check_aws(self) -> Optional[str]:
        # IMDSv2: a session token first (PUT), then the spot notice with it; 404 until there is one.
        for _ in range(2):
            if self._aws_token is None:
                r = self.session.put(self.base_url + "/latest/api/token", timeout=TIMEOUT,
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": AWS_TOKEN_TTL})
                r.raise_for_status()
                self._aws_token = r.text.strip()
            r = self._get("/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": self._aws_token})
            if r.status_code == 401:
                self._aws_token = None  # expired: ask for a new one, once
                continue
            if r.status_code == 404:
                return None
            r.raise_for_status()
            doc = _object(r.text, "spot/instance-action")
            return f"AWS spot instance-action {doc.get('action', '?')!r} at {doc.get('time', '?')!r}"
        return None

    def _check_gcp(self) -> Optional[str]:
        r = self._get("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        r.raise_for_status()
        return "GCP instance/preempted is TRUE" if r.text.strip().upper() == "TRUE" else None

    def _check_azure(self) -> Optional[str]:
        r = self._get("/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
        r.raise_for_status()
        events = _object(r.text, "scheduledevents").get("Events") or []
        if not isinstance(events, list):
            raise ValueError("scheduledevents' Events is not a list")
        for event in events:
            if isinstance(event, dict) and event.get("EventType") == "Preempt":
                return (f"Azure scheduled event Preempt {event.get('EventId', '')!r} "
                        f"not before {event.get('NotBefore', '?')!r}")
        return None


def _object(text: str, what: str) -> dict:
    """The JSON object a metadata answer holds; else a ValueError (an answer of no notice's form)."""
    doc = jsontext.loads(text)
    if not isinstance(doc, dict):
        raise ValueError(f"{what} is JSON but not an object")
    return doc


def notice_watcher(provider: str = "auto", base_url: Optional[str] = None,
                   dmi_dir: Optional[str] = None) -> Optional[NoticeWatcher]:
    """The watcher for `provider` ("auto": from DMI; "none": no notices), or None."""
    if provider == "none":
        return None
    if provider == "auto":
        found = detect_provider(dmi_dir)
        return NoticeWatcher(found, base_url) if found else None
    return NoticeWatcher(provider, base_url)
