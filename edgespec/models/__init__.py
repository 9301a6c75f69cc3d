"""The model catalog and the cache of fetched models."""

from edgespec.config import DEFAULT_MODEL
from edgespec.models.catalog import MODELS, PAIRS, CatalogModel
from edgespec.models.refs import resolve
from edgespec.models.store import FetchProgress, ProgressCallback, Removed, cache_dir, cached_path, fetch, remove

__all__ = ["DEFAULT_MODEL", "MODELS", "PAIRS", "CatalogModel", "FetchProgress", "ProgressCallback", "Removed",
           "cache_dir", "cached_path", "fetch", "remove", "resolve"]
