"""Database: SQLAlchemy 2 models, the async engine and Alembic migrations."""
