"""What runs on more than one database or log: SQLite (tests/unit) and PostgreSQL or tansu
(tests/integration). A check written once takes the URL or a fixture the calling module sets;
where whole tests run on both, the test module of each tier collects them with
``from testing.backends.<topic> import *`` and defines the fixture they take for its back end
(as SQLAlchemy's ``testing.suite`` does for its dialects)."""
