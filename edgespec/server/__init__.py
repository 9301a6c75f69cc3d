"""The editor sidecar and OpenAI-compatible server (`pip install 'edgespec[server]'`)."""

from edgespec.server.app import Settings, create_app, is_loopback, serve

__all__ = ["Settings", "create_app", "is_loopback", "serve"]
