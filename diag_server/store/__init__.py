"""The store: the one owner of the server's SQL (today SQLite; docs/architecture.md).

``Store`` holds the connection(s) and the writer thread (sqlite.py); ``schema`` the tables and their
versioned migrations, run when a store is opened.
"""

from .schema import LATEST as SCHEMA_VERSION, STAT_COLUMNS, SchemaError
from .sqlite import Store, add_message, pack_quantiles, unpack_quantiles

__all__ = ["SCHEMA_VERSION", "STAT_COLUMNS", "SchemaError", "Store", "add_message", "pack_quantiles",
           "unpack_quantiles"]
