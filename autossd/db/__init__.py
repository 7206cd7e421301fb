"""The tuning database: schema and migrations, records, lookup, export and merge.

    models     the SQLAlchemy schema: problem and config as JSON, validated per op on read
    engine     engines (SQLite: WAL, busy timeout, BEGIN IMMEDIATE, retries) and migrations
    records    Record, make_record, validate_row, add_records, read_records
    lookup     db_filename, load_records, pick (exact / nearest / default) and their policies
    exchange   export_db, merge_dbs
"""
from .engine import HEAD, ReadOnlyWALError, TuningDBError, migrate, to_url, upgrade_if_older, with_retries
from .exchange import MergeResult, export_db, merge_dbs, merge_records
from .lookup import (MAX_DISTANCE, Match, clear_cache, db_filename, distance, load_records, choose, pick,
                     shipped_db_path, user_db_url)
from .records import Record, RecordError, add_records, make_record, read_records, validate_row

__all__ = ["HEAD", "MAX_DISTANCE", "Match", "MergeResult", "ReadOnlyWALError", "Record", "RecordError", "TuningDBError",
           "add_records", "clear_cache", "db_filename", "distance", "export_db", "load_records", "choose",
           "make_record", "merge_dbs", "merge_records", "migrate", "pick", "read_records",
           "shipped_db_path", "to_url", "upgrade_if_older", "user_db_url", "validate_row", "with_retries"]
