"""The documentation site (mkdocs.yml: docs/*.md, examples, the API reference from the
docstrings) builds with no warning: `mkdocs build --strict` fails on a broken link, a page
missing from the nav, a docstring mkdocstrings cannot parse, or an example file gone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def text_of(page: Path) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page.read_text()))


def test_the_site_builds_strict(site):
    assert (site / "index.html").exists()


def test_the_api_reference_documents_the_public_classes(site):
    html = (site / "api" / "index.html").read_text()
    for name in ("Channel", "ChannelOptions", "Controller", "Stub", "Server", "ServerOptions",
                 "Servicer", "RpcError", "errors", "RetryPolicy", "FixedBackoffRetryPolicy",
                 "JitteredBackoffRetryPolicy", "RetryThrottle", "BackupRequestPolicy",
                 "RateLimitedBackupPolicy", "LatencyQuantileBackupPolicy", "ResponseStream"):
        assert f'id="aiobrpc.{name}"' in html, name
    text = text_of(site / "api" / "index.html")
    for option in ("max_unwritten_bytes", "backup_request_policy", "non_idempotent_methods",
                   "pool_idle_timeout_s", "first_frame_timeout_sec", "handler_threads"):
        assert option in text, option
    assert "EREQUEST" in text and "1003" in text
    assert "<blockquote>" not in html, "a doctest example rendered as a quote (docs/_ext/doctest_fences.py)"


def test_the_examples_page_includes_the_programs(site):
    page = text_of(site / "examples" / "index.html")
    assert "class EchoService" in page and "package example.kv;" in page and "package example.chat;" in page
