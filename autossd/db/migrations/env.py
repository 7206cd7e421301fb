"""Alembic environment for the tuning database. Run through `autossd.db.engine.migrate`, which
passes an open connection (config.attributes["connection"]); there is no alembic.ini."""
from alembic import context

from autossd.db.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only `alembic` on the command line gets here
    raise RuntimeError("autossd migrations run through autossd.db.engine.migrate(url)")

# transactional_ddl: the whole upgrade commits or none of it (SQLite supports DDL in a
# transaction), so a crash mid-migration leaves the previous schema intact
context.configure(connection=connection, target_metadata=Base.metadata,
                  render_as_batch=True, transactional_ddl=True)
with context.begin_transaction():
    context.run_migrations()
