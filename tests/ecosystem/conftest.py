"""The ecosystem zoo never touches the network: the Hugging Face libraries are told so before they
are imported (the tox env sets the same variables)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
